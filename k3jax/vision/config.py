"""VisionConfig: the vision tower and projector of a multimodal K3-family checkpoint.

Fields carry the names of the release's `config.json` `vision_config` (`vt_hidden_size`, `init_pos_emb_height`,
...), so `VisionConfig.from_dict(hf["vision_config"])` reads a release config directly. Defaults are K3's
MoonViT-V2 (docs/spec.md, "Vision tower"); `VisionConfig.kimi_k25(...)` is the Kimi K2.5 tower, the variant with an
executable reference (transformers' `kimi_k25`), and `from_transformers_k25` reads transformers' renamed fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from k3jax.config import ConfigError

NORM_TYPES = ("rmsnorm", "layernorm")
PROJECTOR_TYPES = ("patchmergerv2", "patchmerger")
INTERPOLATION_MODES = ("bilinear", "bicubic")
MERGE_TYPES = ("sd2_tpool",)
DEFAULT_NORM_EPS = {"rmsnorm": 2.0 ** -7, "layernorm": 1e-5}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT tower + patch-merger projector. Defaults: K3 (27 layers, 1024 wide, 12 heads x 128 over a
    1536-wide qkv, RMSNorm eps 2^-7, no biases, bilinear position grid, `sd2_tpool`, `patchmergerv2` into 7168).

    `norm_eps` (not a release field): the tower norms' epsilon, None = the norm type's default (RMSNorm 2^-7,
    LayerNorm 1e-5). `rope_theta`: base of the 2-D rotary (10000 in both towers)."""

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    activation_func: str = "gelu_pytorch_tanh"
    norm_type: str = "rmsnorm"
    norm_eps: float | None = None
    text_hidden_size: int = 7168
    pos_emb_interpolation_mode: str = "bilinear"
    rope_theta: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "merge_kernel_size", tuple(int(k) for k in self.merge_kernel_size))
        self._check()

    def _check(self):
        for name, value, allowed in (("norm_type", self.norm_type, NORM_TYPES),
                                     ("mm_projector_type", self.mm_projector_type, PROJECTOR_TYPES),
                                     ("pos_emb_interpolation_mode", self.pos_emb_interpolation_mode,
                                      INTERPOLATION_MODES),
                                     ("merge_type", self.merge_type, MERGE_TYPES),
                                     ("activation_func", self.activation_func, ("gelu_pytorch_tanh",)),
                                     ("projector_hidden_act", self.projector_hidden_act, ("gelu",))):
            if value not in allowed:
                raise ConfigError(f"vision_config.{name} = {value!r} is not supported (supported: {allowed})")
        for name in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "vt_num_attention_heads",
                     "vt_num_hidden_layers", "vt_hidden_size", "vt_intermediate_size", "qkv_hidden_size",
                     "text_hidden_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"vision_config.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            raise ConfigError("vision_config.merge_kernel_size must be two positive ints, got "
                              f"{self.merge_kernel_size}")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise ConfigError(f"vision_config.qkv_hidden_size ({self.qkv_hidden_size}) must be a multiple of "
                              f"vt_num_attention_heads ({self.vt_num_attention_heads})")
        if self.head_dim % 4:
            raise ConfigError(f"vision_config: head dim {self.head_dim} must be a multiple of 4 (2-D rotary)")
        if self.mm_hidden_size != self.vt_hidden_size:
            raise ConfigError(f"vision_config.mm_hidden_size ({self.mm_hidden_size}) must equal vt_hidden_size "
                              f"({self.vt_hidden_size})")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def tower_norm_eps(self) -> float:
        return DEFAULT_NORM_EPS[self.norm_type] if self.norm_eps is None else self.norm_eps

    @property
    def merge_size(self) -> int:
        """Patches per merged token (kh * kw)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token, the projector's input (4 * 1024 = 4096 in K3)."""
        return self.vt_hidden_size * self.merge_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **overrides) -> "VisionConfig":
        """From a release `vision_config` (or `to_dict()`); fields this tower does not model are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def kimi_k25(cls, **overrides) -> "VisionConfig":
        """The Kimi K2.5 tower (LayerNorm eps 1e-5 with biases, qkv width = hidden, bicubic position grid,
        `patchmerger` with a LayerNorm before the MLP); sizes default to K2.5's, override for tiny tests."""
        kw = dict(vt_num_attention_heads=16, vt_hidden_size=1152, vt_intermediate_size=4304, qkv_hidden_size=1152,
                  mm_hidden_size=1152, attn_bias=True, linear_bias=True, patch_embed_proj_bias=True,
                  mm_projector_type="patchmerger", norm_type="layernorm", pos_emb_interpolation_mode="bicubic")
        kw.update(overrides)
        for tied in ("qkv_hidden_size", "mm_hidden_size"):
            if tied not in overrides:
                kw[tied] = kw["vt_hidden_size"]
        return cls(**kw)

    @classmethod
    def from_transformers_k25(cls, vision: Mapping[str, Any], *, text_hidden_size: int,
                              projection_layer_norm_eps: float = 1e-5) -> "VisionConfig":
        """From transformers' `Kimi_K25VisionConfig.to_dict()` (its renamed fields) and the text width."""
        if vision.get("pos_emb_height") != vision.get("pos_emb_width"):
            raise ConfigError("transformers' kimi_k25 tower uses a square position grid; got "
                              f"{vision.get('pos_emb_height')} x {vision.get('pos_emb_width')}")
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls.kimi_k25(
            patch_size=vision["patch_size"], init_pos_emb_height=vision["pos_emb_height"],
            init_pos_emb_width=vision["pos_emb_width"], init_pos_emb_time=vision["pos_emb_time"],
            vt_num_attention_heads=vision["num_attention_heads"], vt_num_hidden_layers=vision["num_hidden_layers"],
            vt_hidden_size=vision["hidden_size"], vt_intermediate_size=vision["intermediate_size"],
            merge_kernel_size=tuple(vision["merge_kernel_size"]), text_hidden_size=text_hidden_size,
            projector_ln_eps=projection_layer_norm_eps, rope_theta=float(theta))
