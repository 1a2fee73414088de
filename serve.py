"""Serve a k3jax model: batch mode (prompts file → JSONL) or an OpenAI-compatible HTTP server.

Batch mode:

    python serve.py --config=tiny --prompts_file=prompts.txt --max_new_tokens=64 --out=out.jsonl

`--prompts_file`: `.jsonl` (objects with "prompt" text, "prompt_ids" or "messages", optional "id") or plain text,
one prompt per line. Output: one JSON object per prompt, in input order: index, [id], [prompt], completion,
completion_ids, finish_reason, token counts. "prompt" / "prompt_ids" are fed as they are (BOS added to text);
"messages" is a chat conversation as /v1/chat/completions takes it, rendered by the chat template, and its image
parts may name local image files (a path relative to the prompts file, a file:// URL, or a data: URL; a .npy of a
uint8 [H, W, 3] array, or PNG/JPEG with Pillow), read with the --checkpoint / --hf_dir vision tower:

    {"id": "cat", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                                            {"type": "text", "text": "What is in this picture?"}]}]}

A missing or unreadable image stops the run before anything is generated, naming the line and the file.

Server mode (continuous batching over `--slots` decode slots; MLA latents in a pool of `--num_pages` pages of
`--page_size` tokens per layer; see k3jax/inference/server.py and scheduler.py):

    python serve.py --config=tiny --port=8000
    curl localhost:8000/v1/completions --json '{"prompt": "def f(x):", "max_tokens": 32, "temperature": 0}'
    curl -N localhost:8000/v1/chat/completions --json '{"messages": [{"role": "user", "content": "hi"}], "stream":true}'

Access (k3jax/inference/access.py): the server listens on 127.0.0.1 and answers only requests whose Host names it
(localhost, the bound or connected address, `--allowed_hosts`), without a browser Origin (unless in
`--allowed_origins`) and with JSON bodies (`--norequire_json` also takes curl -d's form type). Anyone who can reach
the port can use the model: before binding another address (`--host=0.0.0.0`) set an API key (`--api_key`, or the
K3JAX_API_KEY environment variable, which stays out of process listings; clients send `Authorization: Bearer KEY`)
and name the server's DNS names in `--allowed_hosts`; the key travels in clear text, so use a TLS proxy across
untrusted networks (docs/serving.md).

Weights: `--hf_dir` (HF K3 / Kimi-Linear directory; its tokenizer and chat template are used) or `--checkpoint`
(k3jax Orbax checkpoint); with neither, the `--config` model is randomly initialised (a warning says so) and the
byte tokenizer is used. `--expert_weights=mxfp4` keeps the routed experts packed at 4.25 bits per weight in device
memory (MXFP4 experts of the HF release / an `--experts mxfp4` checkpoint copied as-is, bf16 ones quantized),
run by the MXFP4 grouped matmul. SIGINT / SIGTERM shut the server down gracefully. At start-up the engine compiles
every prefill bucket and the decode step (one progress line each; k3jax/inference/warmup.py; `--warm_up=shortest`
for a quick start) while the server already listens: /health answers 503 "warming up" until then, and requests
wait for it.

The prefix cache is on (`--prefix_block=512`; `0` turns it off): prompts are prefilled in 512-token chunks, one
request at a time, and KDA state snapshots kept at chunk ends (every 512 tokens up to `--prefix_long_threshold`,
every `--prefix_long_block` = 6144 past it) let a later prompt with the same start resume from the longest one;
snapshots take at most `--prefix_cache_gib` of device memory (docs/serving.md#prefix-cache).

Images: with a vision tower in `--checkpoint` / `--hf_dir`, chat `content` parts may be images, as data URLs only
(`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`; PNG/JPEG need Pillow, the `[vision]`
extra; `data:application/x-npy;base64,...` needs nothing); other URLs get 400 (no network fetches).

Speculative decoding (`--speculative=mtp|eagle3 --num_draft_tokens=K [--draft=PATH]`): the draft proposes K tokens
per step, the model verifies them in one forward; greedy output is unchanged. It switches itself off while more than
`--speculative_max_batch` (32) sequences run and while too few drafted tokens are accepted to pay
(`--speculative_min_accepted`, by default the break-even measured at warm-up from the plain and speculative step
times; re-probed every `--speculative_probe_every` plain steps); /health reports acceptance
(docs/serving.md#speculative-decoding).

`--mesh=D,E,C,M` (data, expert, context, model; as train.py, context must be 1) serves on a device mesh: weights
are loaded straight into their shardings (`--hf_dir` / `--checkpoint`), the decode caches are sharded (sequences
over data x expert, KDA heads over model) and the MoE runs expert-parallel when E > 1 (k3jax/inference/sharded.py).
"""

import functools
import ipaddress
import logging
import os
import sys

import jax
from absl import app, flags

import configs
from k3jax.atomic import os_error
from k3jax.config import ConfigError
from k3jax.inference.access import policy_from_flags
from k3jax.inference.batch import BatchOptions, load_model, make_tokenizer, read_prompts, run_batch, validate
from k3jax.inference.chat import load_chat_template
from k3jax.inference.engine import Engine
from k3jax.inference.engine_loop import EngineLoop
from k3jax.inference.image_slots import default_placeholder_id, load_serving_vision
from k3jax.inference.prefix_cache import DEFAULT_BLOCK, DEFAULT_LONG_BLOCK, DEFAULT_THRESHOLD
from k3jax.inference.scheduler import Scheduler
from k3jax.inference.server import K3Server, ServerOptions, run_server
from k3jax.inference.sharded import mesh_from_spec
from k3jax.inference.spec_scheduler import (
    DEFAULT_MAX_SPEC_BATCH,
    DEFAULT_PROBE_EVERY,
    DRAFT_KINDS,
    SpeculativeScheduler,
    check_draft_kind,
    make_draft,
)
from k3jax.inference.speculative import SpeculativeEngine
from k3jax.inference.warmup import warm_up
from k3jax.inference.xla_flags import apply_serving_flags
from k3jax.loading import load_checkpoint, load_hf
from sharding.mesh import describe
from sharding.rules import SERVING_AXIS_RULES

_CONFIG = flags.DEFINE_string("config", "tiny", f"Named config (ignored with --hf_dir/--checkpoint): "
                              f"{', '.join(configs.names())}.")
_SET = flags.DEFINE_multi_string("set", [], "Config override key=value (repeatable).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "k3jax Orbax checkpoint directory (default: random init).")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF model directory (K3 or Kimi-Linear format).")
_EXPERT_WEIGHTS = flags.DEFINE_enum("expert_weights", None, ["bf16", "mxfp4"], "How the routed experts are held "
                                     "in device memory: bf16 (the parameter dtype) or mxfp4 (packed, 4.25 bits "
                                     "per weight; inference only). Default: the config's (bf16).")
_UNROLL = flags.DEFINE_bool("unroll_layers", True, "Serve with the layer stack unrolled (scan_layers=False) unless "
                             "--set scan_layers=... says otherwise: the layer scan slices every layer's weights out "
                             "of the stacked arrays at each decode step (copies; 2x slower decode on an H200, "
                             "benchmarks/RESULTS.md); unrolled compiles slower for deep models.")
_XLA_DEFAULTS = flags.DEFINE_bool("xla_defaults", True, "Add k3jax's serving XLA flags to XLA_FLAGS (GPU: run "
                                  "independent kernels of a decode step concurrently; k3jax/inference/xla_flags.py). "
                                  "A flag already in XLA_FLAGS keeps its value. Not with --mesh (untested there).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for the random init (and batch-mode sampling).")
_MESH = flags.DEFINE_string("mesh", None, "data,expert,context,model sizes (e.g. 1,2,1,4; context must be 1) to "
                            "serve on a device mesh; default: one device.")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "Max tokens per sequence (prompt + generated); default: the "
                                "config's max_position_embeddings in batch mode, 2048 in server mode.")
# batch mode
_PROMPTS = flags.DEFINE_string("prompts_file", None, "Batch mode: prompts, .jsonl (\"prompt\", \"prompt_ids\" or "
                                "chat \"messages\" whose image parts may name local files) or .txt (one prompt per "
                                "line).")
_OUT = flags.DEFINE_string("out", None, "Batch mode: output JSONL path.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Batch mode: tokens to generate per prompt (at most).")
_TEMP = flags.DEFINE_float("temperature", 0.0, "Batch mode: sampling temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Batch mode: top-k filter; 0 = off.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Batch mode: top-p (nucleus) filter; 1 = off.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Batch mode: prompts per generation batch.")
# server mode
_PORT = flags.DEFINE_integer("port", None, "Server mode: serve HTTP on this port.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Server mode: address to bind (0.0.0.0 for all interfaces).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Server mode: decode slots (sequences decoded together).")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 64, "Server mode: requests waiting for a slot before 503.")
_PREFILL_BATCH = flags.DEFINE_integer("max_prefill_batch", 1, "Server mode: requests prefilled per call "
                                      "(power of two).")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "Server mode: decode steps per device call.")
_PREFIX_BLOCK = flags.DEFINE_integer("prefix_block", DEFAULT_BLOCK, "Server mode: prefix cache chunk and KDA "
                                     "state checkpoint interval in tokens (a power of two >= 16; the release's "
                                     "512); 0 = no prefix cache (prompts are then prefilled in batches of "
                                     "--max_prefill_batch instead of one at a time).")
_PREFIX_LONG_BLOCK = flags.DEFINE_integer("prefix_long_block", DEFAULT_LONG_BLOCK, "Server mode: past "
                                          "--prefix_long_threshold tokens, checkpoints only at multiples of this "
                                          "(a multiple of --prefix_block; the release's 6144); 0 = every block.")
_PREFIX_THRESHOLD = flags.DEFINE_integer("prefix_long_threshold", DEFAULT_THRESHOLD, "Server mode: checkpoints "
                                         "every --prefix_block tokens up to this position, then every "
                                         "--prefix_long_block.")
_PREFIX_GIB = flags.DEFINE_float("prefix_cache_gib", 0.0, "Server mode: device memory bound of the prefix cache's "
                                 "snapshots in GiB (least recently used dropped first); 0 = automatic: a quarter "
                                 "of the memory free once the decode cache is allocated (1 GiB where the device "
                                 "reports none, e.g. CPU).")
_PREFIX_CAPACITY = flags.DEFINE_integer("prefix_capacity", 0, "Server mode: most prefix cache snapshots kept (LRU); "
                                        "0 = bounded by --prefix_cache_gib only.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "Server mode: tokens per MLA latent page (>= 1; capped at "
                                  "--max_len; a multiple of 64, the prefill chunk, suits real models).")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 0, "Server mode: pages in each MLA layer's latent pool; 0 = "
                                  "automatic, slots x ceil(max_len / page_size) (every slot at full length). Fewer "
                                  "pages use less memory; requests then wait for pages, and one needing more than "
                                  "the pool gets a 400.")
_DEFAULT_MAX = flags.DEFINE_integer("default_max_tokens", 256, "Server mode: chat max_tokens when not given.")
_GRACE = flags.DEFINE_float("shutdown_grace_s", 10.0, "Server mode: seconds in-flight requests get to finish "
                            "on shutdown before they are cancelled.")
_API_KEY = flags.DEFINE_string("api_key", None, "Server mode: require 'Authorization: Bearer KEY' on /v1/* "
                               "(default: the K3JAX_API_KEY environment variable; neither: no key). Set one before "
                               "binding a non-loopback --host.")
_ALLOWED_HOSTS = flags.DEFINE_list("allowed_hosts", [], "Server mode: further Host header names to accept (the "
                                   "server's DNS names behind --host=0.0.0.0 or a proxy; * = any). Localhost, the "
                                   "bound and the connected address are always accepted; others get 421.")
_ALLOWED_ORIGINS = flags.DEFINE_list("allowed_origins", [], "Server mode: browser page origins (e.g. "
                                     "https://app.example) allowed to call the API, with CORS headers; * = any. "
                                     "Requests from other origins get 403.")
_REQUIRE_JSON = flags.DEFINE_bool("require_json", True, "Server mode: refuse POST bodies labelled other than "
                                  "application/json (415): text/plain and form bodies are what a web page can send "
                                  "cross-origin unasked. --norequire_json accepts them (curl -d).")
_WARM_UP = flags.DEFINE_enum("warm_up", "all", ["all", "shortest"], "Server mode: prefill programs compiled at "
                              "start-up, before /health says ok: all (every prompt-length and prefill-batch bucket: "
                              "no request ever waits for a compile; minutes on a CPU) or shortest (the shortest "
                              "bucket: a quick start for development; a new prompt length then stalls every "
                              "stream while it compiles). The decode steps are always compiled.")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "Server mode: the model id in the API (default: the "
                                  "config name).")
# speculative decoding (both modes)
_SPECULATIVE = flags.DEFINE_enum("speculative", None, list(DRAFT_KINDS), "Decode speculatively with this draft: "
                                 "mtp (the model's MTP layer) or eagle3; greedy output is unchanged, sampled output "
                                 "keeps the model's distribution (docs/serving.md#speculative-decoding).")
_NUM_DRAFT = flags.DEFINE_integer("num_draft_tokens", 3, "With --speculative: tokens drafted per step (>= 1).")
_DRAFT = flags.DEFINE_string("draft", None, "With --speculative: the draft's weights (mtp: an HF directory with the "
                             "DeepSeek-style model.layers.{N}.* MTP tensors, or a k3jax checkpoint with an MTP "
                             "layer); default: --hf_dir / --checkpoint; none given: random.")
_SPEC_MAX_BATCH = flags.DEFINE_integer("speculative_max_batch", DEFAULT_MAX_SPEC_BATCH, "Server mode with "
                                       "--speculative: a step with more running sequences than this decodes "
                                       "plainly (verifying k+1 tokens per sequence stops paying at large batches); "
                                       "0 = never speculate.")
_SPEC_MIN_ACCEPTED = flags.DEFINE_float("speculative_min_accepted", None, "Server mode with --speculative: decode "
                                        "plainly while the running mean of drafted tokens accepted per verification "
                                        "is below this (default: the break-even measured at warm-up from the "
                                        "plain and speculative step times; at or above --num_draft_tokens "
                                        "speculation never runs); 0 = never switch off.")
_SPEC_PROBE_EVERY = flags.DEFINE_integer("speculative_probe_every", DEFAULT_PROBE_EVERY, "Server mode with "
                                         "--speculative: after this many plain steps switched off by low acceptance, "
                                         "try speculating again.")
_VISION = flags.DEFINE_bool("vision", True, "Accept images in chat requests (batch mode: chat records) when "
                            "--checkpoint / --hf_dir has a vision tower (--novision: serve the text model alone).")
_PLACEHOLDER = flags.DEFINE_integer("image_placeholder_id", -1, "The token id a prompt holds once per "
                                    "image token; -1 = automatic: <|media_pad|> (163605) where the vocabulary has it, "
                                    "else 259 (byte-tokenized tiny models).")


def _serve(log, mesh) -> None:
    for name, flag, low in (("--slots", _SLOTS, 1), ("--max_queue", _MAX_QUEUE, 0), ("--decode_steps",
                                                                                       _DECODE_STEPS, 1),
                            ("--default_max_tokens", _DEFAULT_MAX, 1), ("--max_prefill_batch", _PREFILL_BATCH, 1),
                            ("--page_size", _PAGE_SIZE, 1), ("--num_pages (0 = automatic)", _NUM_PAGES, 0),
                            ("--prefix_block (0 = off)", _PREFIX_BLOCK, 0), ("--prefix_capacity", _PREFIX_CAPACITY, 0),
                            ("--prefix_long_block", _PREFIX_LONG_BLOCK, 0),
                            ("--prefix_long_threshold", _PREFIX_THRESHOLD, 0), ("--prefix_cache_gib", _PREFIX_GIB, 0)):
        if flag.value < low:
            raise ValueError(f"{name} must be >= {low}, got {flag.value}")
    block = _PREFIX_BLOCK.value
    if block and (block < 16 or block & (block - 1)):
        raise ValueError(f"--prefix_block must be 0 (off) or a power of two >= 16, got {block}")
    if block and _PREFIX_LONG_BLOCK.value % block:
        raise ValueError(f"--prefix_long_block must be 0 or a multiple of --prefix_block={block}, got "
                         f"{_PREFIX_LONG_BLOCK.value}")
    if not 0 < _PORT.value < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {_PORT.value}")
    if _PROMPTS.value or _OUT.value:
        raise ValueError("--port (server mode) cannot be combined with --prompts_file/--out (batch mode)")
    access = policy_from_flags(_API_KEY.value, _HOST.value, _ALLOWED_HOSTS.value, _ALLOWED_ORIGINS.value,
                               _REQUIRE_JSON.value, os.environ)
    if access.api_key is None and not _is_loopback(_HOST.value):
        log(f"warning: serving on --host={_HOST.value} without an API key: anyone who can reach the port can use "
            "the model (set --api_key or K3JAX_API_KEY)")
    opts = _Opts()
    cfg, model = _load_model(opts, mesh, log)
    source = _HF_DIR.value or _CHECKPOINT.value
    tokenizer = make_tokenizer(cfg, source)
    chat = load_chat_template(tokenizer, source)
    max_len = _MAX_LEN.value or min(2048, cfg.max_position_embeddings)
    sched_cls = _scheduler_class(model, mesh, log)
    scheduler = sched_cls(model, num_slots=_SLOTS.value, max_len=max_len, max_prefill_batch=_PREFILL_BATCH.value,
                          decode_steps=_DECODE_STEPS.value, prefix_block=_PREFIX_BLOCK.value or None,
                          prefix_capacity=_PREFIX_CAPACITY.value or None, page_size=_PAGE_SIZE.value,
                          num_pages=_NUM_PAGES.value or None, mesh=mesh, prefix_long_block=_PREFIX_LONG_BLOCK.value,
                          prefix_long_threshold=_PREFIX_THRESHOLD.value,
                          prefix_bytes=max(1, int(_PREFIX_GIB.value * 2**30)) if _PREFIX_GIB.value else None)
    _attach_vision(scheduler, cfg, mesh, log)
    if scheduler.num_pages < scheduler.pages_per_seq:
        log(f"note: --num_pages={scheduler.num_pages} holds {scheduler.num_pages * scheduler.page_size} tokens, "
            f"less than one sequence of --max_len={max_len}: longer requests get a 400")
    every = _WARM_UP.value == "all"
    engine = EngineLoop(scheduler, log, warm_up=lambda: warm_up(scheduler, log, every))  # compiles before serving
    server = K3Server(engine, tokenizer, chat,
                      ServerOptions(model_name=_MODEL_NAME.value or cfg.name, max_queue=_MAX_QUEUE.value,
                                    default_max_tokens=_DEFAULT_MAX.value, shutdown_grace_s=_GRACE.value,
                                    access=access), log)
    run_server(server, _HOST.value, _PORT.value)


def _check_speculative_flags() -> None:
    """Flag errors of --speculative and friends, before any model is loaded."""
    if not _SPECULATIVE.value:
        if _DRAFT.value:
            raise ValueError("--draft needs --speculative")
        return
    if _NUM_DRAFT.value < 1:
        raise ValueError(f"--num_draft_tokens must be >= 1, got {_NUM_DRAFT.value}")
    if _SPEC_MAX_BATCH.value < 0:
        raise ValueError(f"--speculative_max_batch must be >= 0, got {_SPEC_MAX_BATCH.value}")
    if _SPEC_PROBE_EVERY.value < 1:
        raise ValueError(f"--speculative_probe_every must be >= 1, got {_SPEC_PROBE_EVERY.value}")
    check_draft_kind(_SPECULATIVE.value)
    if _SPECULATIVE.value == "eagle3" and not _DRAFT.value:
        raise ValueError("--speculative=eagle3 needs --draft=PATH (a draft directory saved by its training)")


def _draft(model, log):
    path = _DRAFT.value or _HF_DIR.value or _CHECKPOINT.value
    return make_draft(_SPECULATIVE.value, _NUM_DRAFT.value, model, path, log, _SEED.value)


def _scheduler_class(model, mesh, log):
    """`Scheduler`, or with --speculative a `SpeculativeScheduler` bound to its draft."""
    if not _SPECULATIVE.value:
        return Scheduler
    return functools.partial(SpeculativeScheduler, draft=_draft(model, log), max_spec_batch=_SPEC_MAX_BATCH.value,
                             min_accepted_per_step=_SPEC_MIN_ACCEPTED.value, probe_every=_SPEC_PROBE_EVERY.value,
                             draft_name=_SPECULATIVE.value)


def _attach_vision(scheduler, cfg, mesh, log) -> None:
    """Image input for the scheduler when the weights carry a vision tower (and --vision)."""
    if not _VISION.value:
        return
    vision = load_serving_vision(checkpoint=_CHECKPOINT.value, hf_dir=_HF_DIR.value)
    if vision is None:
        return
    if mesh is not None:
        raise ValueError("image input on a device mesh is not supported yet (--novision serves the text model alone)")
    placeholder = _PLACEHOLDER.value if _PLACEHOLDER.value >= 0 else default_placeholder_id(cfg)
    scheduler.attach_vision(vision, placeholder)
    log(f"vision tower loaded: chat requests may carry images (placeholder id {placeholder})")


def _load_model(opts, mesh, log):
    """(config, model): `k3jax.inference.batch.load_model`, except that with a mesh the weights are loaded straight
    into their shardings on it (a random init is built on one device and placed by the Engine / Scheduler)."""
    if mesh is None or not (opts.hf_dir or opts.checkpoint):
        return load_model(opts, log)
    if opts.checkpoint and opts.hf_dir:
        raise ValueError("give --checkpoint or --hf_dir, not both")
    log(f"loading onto the mesh {describe(mesh)}")
    if opts.hf_dir:
        return load_hf(opts.hf_dir, overrides=list(opts.overrides), mesh=mesh, rules=SERVING_AXIS_RULES)
    return load_checkpoint(opts.checkpoint, overrides=list(opts.overrides), mesh=mesh, rules=SERVING_AXIS_RULES)


def _is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Opts:
    """The model-loading options `load_model` reads, from the flags."""

    def __init__(self):
        self.config, self.overrides = _CONFIG.value, _overrides()
        self.checkpoint, self.hf_dir, self.seed = _CHECKPOINT.value, _HF_DIR.value, _SEED.value


def _overrides() -> tuple[str, ...]:
    """`--set` overrides plus `--expert_weights` (a runtime choice the loaders and configs all accept)."""
    extra = (f"expert_weights={_EXPERT_WEIGHTS.value}",) if _EXPERT_WEIGHTS.value else ()
    if _UNROLL.value and not any(s.split("=")[0].strip().removeprefix("runtime.") == "scan_layers"
                                 for s in _SET.value):
        extra += ("scan_layers=False",)
    return tuple(_SET.value) + extra


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for name in ("absl", "jax"):  # our own lines only: no Orbax INFO line per array of --checkpoint
        logging.getLogger(name).setLevel(logging.WARNING)
    if _XLA_DEFAULTS.value and not _MESH.value:  # measured on one GPU only (not with NCCL inside the graphs)
        added = apply_serving_flags()
        if added and jax.default_backend() == "gpu":  # GPU-only flags: no line on a CPU or TPU run
            log(f"serve.py: XLA_FLAGS += {' '.join(added)} (--noxla_defaults to leave XLA_FLAGS as it is)")
    try:
        if not (_CHECKPOINT.value or _HF_DIR.value):
            configs.get_config(_CONFIG.value, list(_overrides()))  # fail fast on a bad config name / override
        mesh = mesh_from_spec(_MESH.value)
        _check_speculative_flags()
        if _PORT.value is not None:
            _serve(log, mesh)
            return
        opts = BatchOptions(config=_CONFIG.value, overrides=_overrides(), checkpoint=_CHECKPOINT.value,
                            hf_dir=_HF_DIR.value, prompts_file=_PROMPTS.value or "", out=_OUT.value or "",
                            max_new_tokens=_MAX_NEW.value, temperature=_TEMP.value, top_k=_TOP_K.value,
                            top_p=_TOP_P.value, seed=_SEED.value, batch_size=_BATCH.value, max_len=_MAX_LEN.value,
                            vision=_VISION.value, image_placeholder_id=_PLACEHOLDER.value)
        engine = None
        if mesh is not None or _SPECULATIVE.value:
            validate(opts)  # flag and prompts-file errors before loading
            read_prompts(opts.prompts_file)
            model = _load_model(opts, mesh, log)[1]
            if _SPECULATIVE.value:
                engine = SpeculativeEngine(model, _draft(model, log), max_len=opts.max_len, mesh=mesh)
            else:
                engine = Engine(model, mesh=mesh)
        run_batch(opts, engine=engine)
    except (ValueError, ConfigError, NotImplementedError) as e:  # also non-finite weights (refused on load)
        print(f"serve.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # an unwritable --out, an unreadable checkpoint, a port already in use
        print(f"serve.py: error: {os_error(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
