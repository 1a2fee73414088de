"""The README's first command works: a short `tiny` run with the real pipeline (per-head Muon, Quantile Balancing,
MTP, packed Grain data from the embedded corpus) lowers the loss; bad input fails with a clear error."""

import pytest

import configs
from k3jax.data.text import ByteTokenizer, stdlib_corpus
from k3jax.training.trainer import TrainOptions, train


@pytest.mark.slow
def test_tiny_training_loss_falls():
    # `tiny` cut to 5 layers (every layer kind: KDA, MLA, dense and MoE FFNs): the 13-layer step's compile dominated
    # this test (~130 s of the suite on 2 cores); the README's first command trains the full `tiny`
    cfg = configs.get_config("tiny", ["num_hidden_layers=5", "full_attn_layers=(4,5)"])
    logs = []
    losses = train(cfg, TrainOptions(steps=30, batch_size=4, seq_len=64, log_every=10, mesh="1,1,1,1"),
                   log_fn=logs.append)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"loss did not fall: {losses[0]:.3f} -> {losses[-5:]}"
    assert any("tokens/s" in line and "mtp" in line and "load max/mean" in line for line in logs), logs


def test_byte_tokenizer_round_trip_and_corpus():
    tok = ByteTokenizer(256, 257, 258, 384)
    ids = tok.encode("héllo", add_bos=True, add_eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and tok.decode(ids) == "héllo"
    assert len(stdlib_corpus(max_bytes=1 << 16)) > 0
    with pytest.raises(ValueError, match="special ids"):
        ByteTokenizer(10, 257, 258, 384)


def test_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="vocab_size=200"):
        train(configs.get_config("tiny", ["vocab_size=200"]), TrainOptions(steps=1, mesh="1,1,1,1"))
