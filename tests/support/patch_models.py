"""Small torch models whose `load_weights` behave like vLLM's loaders, for `hotload_patch` tests.

`ToyTPModel` is one tensor-parallel rank of a tiny Llama-style model, laid out the way vLLM lays
it out: q/k/v (weights and biases) fused into `qkv_proj` at row offsets, gate/up merged into
`gate_up_proj`, the vocabulary padded (rows copied, the padding filled with `fill_`), o_proj and
down_proj row-parallel (the checkpoint narrowed along dim 1), the norms replicated on every rank,
and `lm_head` tied to the embedding (the loader skips `lm_head.weight`). Each loader narrows the
checkpoint tensor for its rank and `copy_`s it into a view of the parameter, as vLLM's
`weight_loader`s do; `transpose_down` keeps down_proj transposed (copied through `.t()`).

`ScriptedModel` is one parameter with a loader given as a function, for loaders a patch must
or must not follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

#: checkpoint name fragment -> (fused parameter fragment, shard id), as in vLLM's Llama.
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of the toy model (every sharded size divisible by the ranks used)."""

    hidden: int = 16
    q: int = 16
    kv: int = 8
    inter: int = 24
    vocab: int = 50
    vocab_padding: int = 32
    layers: int = 2

    @property
    def padded_vocab(self) -> int:
        """The vocabulary rounded up to `vocab_padding`, as vLLM pads it."""
        return -(-self.vocab // self.vocab_padding) * self.vocab_padding


def checkpoint_weights(cfg: ToyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A float32 checkpoint of the toy model under Hugging Face Llama names (lm_head included)."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    h = cfg.hidden
    w = {"model.embed_tokens.weight": rand(cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = rand(h)
        w[f"{p}.self_attn.q_proj.weight"] = rand(cfg.q, h)
        w[f"{p}.self_attn.k_proj.weight"] = rand(cfg.kv, h)
        w[f"{p}.self_attn.v_proj.weight"] = rand(cfg.kv, h)
        w[f"{p}.self_attn.q_proj.bias"] = rand(cfg.q)
        w[f"{p}.self_attn.k_proj.bias"] = rand(cfg.kv)
        w[f"{p}.self_attn.v_proj.bias"] = rand(cfg.kv)
        w[f"{p}.self_attn.o_proj.weight"] = rand(h, cfg.q)
        w[f"{p}.mlp.gate_proj.weight"] = rand(cfg.inter, h)
        w[f"{p}.mlp.up_proj.weight"] = rand(cfg.inter, h)
        w[f"{p}.mlp.down_proj.weight"] = rand(h, cfg.inter)
    w["model.norm.weight"] = rand(h)
    w["lm_head.weight"] = rand(cfg.vocab, h)
    return w


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a snapshot folder, as torch tensors of the checkpoint's dtype."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _put(root: nn.Module, dotted: str, param: nn.Parameter) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, param)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """vLLM's default: the whole tensor into the whole parameter."""
    assert param.size() == loaded.size(), (param.size(), loaded.size())
    param.data.copy_(loaded)


class ToyTPModel(nn.Module):
    """Rank `rank` of `world` of the toy model (see the module docstring)."""

    def __init__(
        self,
        cfg: ToyConfig,
        *,
        rank: int = 0,
        world: int = 1,
        dtype: torch.dtype = torch.float32,
        transpose_down: bool = False,
    ) -> None:
        super().__init__()
        self.cfg, self.rank, self.world = cfg, rank, world
        self.transpose_down = transpose_down
        h, n = cfg.hidden, world
        qkv = (cfg.q + 2 * cfg.kv) // n

        def new(*shape: int) -> nn.Parameter:
            # NaN until loaded: an element no loader writes shows in every comparison.
            return nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)

        embed = new(cfg.padded_vocab // n, h)
        embed.weight_loader = self._vocab_loader  # type: ignore[attr-defined]
        _put(self, "model.embed_tokens.weight", embed)
        for i in range(cfg.layers):
            p = f"model.layers.{i}"
            _put(self, f"{p}.input_layernorm.weight", new(h))
            for kind in ("weight", "bias"):
                fused = new(qkv, h) if kind == "weight" else new(qkv)
                fused.weight_loader = self._qkv_loader  # type: ignore[attr-defined]
                _put(self, f"{p}.self_attn.qkv_proj.{kind}", fused)
            o_proj = new(h, cfg.q // n)
            o_proj.weight_loader = self._row_loader  # type: ignore[attr-defined]
            _put(self, f"{p}.self_attn.o_proj.weight", o_proj)
            gate_up = new(2 * cfg.inter // n, h)
            gate_up.weight_loader = self._gate_up_loader  # type: ignore[attr-defined]
            _put(self, f"{p}.mlp.gate_up_proj.weight", gate_up)
            if transpose_down:
                down = new(cfg.inter // n, h)
                down.weight_loader = self._transposed_row_loader  # type: ignore[attr-defined]
            else:
                down = new(h, cfg.inter // n)
                down.weight_loader = self._row_loader  # type: ignore[attr-defined]
            _put(self, f"{p}.mlp.down_proj.weight", down)
        _put(self, "model.norm.weight", new(h))
        self.lm_head = nn.Module()
        self.lm_head.weight = embed  # tied: one Parameter under two names

    # --- vLLM-style weight loaders ----------------------------------------------------------

    def _merged_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int
    ) -> None:
        """A column-parallel piece of a fused parameter: rows `offset .. offset + size` of the
        whole fused output, this rank's share of them."""
        shard = size // self.world
        dst = param.data.narrow(0, offset // self.world, shard)
        dst.copy_(loaded.narrow(0, self.rank * shard, shard))

    def _qkv_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        cfg = self.cfg
        offset, size = {"q": (0, cfg.q), "k": (cfg.q, cfg.kv), "v": (cfg.q + cfg.kv, cfg.kv)}[
            shard_id
        ]
        self._merged_loader(param, loaded, offset, size)

    def _gate_up_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        self._merged_loader(param, loaded, shard_id * self.cfg.inter, self.cfg.inter)

    def _row_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        shard = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.rank * shard, shard))

    def _transposed_row_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """A row-parallel weight kept transposed: this rank's columns through `.t()`."""
        shard = param.shape[0]
        param.data.t().copy_(loaded.narrow(1, self.rank * shard, shard))

    def _vocab_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        per_rank = param.shape[0]
        # As vLLM's shard indices: clamped, so a rank may hold padding only.
        start = min(self.rank * per_rank, loaded.shape[0])
        size = min(per_rank, loaded.shape[0] - start)
        loaded = loaded.narrow(0, start, size)
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0] :].data.fill_(0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's `load_weights`: stacked names to their fused parameter, lm_head skipped."""
        params = dict(self.named_parameters())
        done: set[str] = set()
        for name, loaded in weights:
            if name == "lm_head.weight":
                continue  # tied to the embedding
            for fused, piece, shard_id in STACKED:
                if piece in name:
                    target = name.replace(piece, fused)
                    param = params[target]
                    param.weight_loader(param, loaded, shard_id)  # type: ignore[attr-defined]
                    break
            else:
                target = name
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, loaded)
            done.add(target)
        return done


def load_ranks(
    folder: Path,
    cfg: ToyConfig,
    world: int,
    dtype: torch.dtype,
    *,
    transpose_down: bool = False,
) -> list[ToyTPModel]:
    """Every rank of the toy model, each loaded in full from snapshot `folder`."""
    tensors = read_checkpoint(folder)
    ranks = []
    for rank in range(world):
        model = ToyTPModel(cfg, rank=rank, world=world, dtype=dtype, transpose_down=transpose_down)
        model.load_weights(tensors.items())
        ranks.append(model)
    return ranks


class ScriptedModel(nn.Module):
    """One parameter `weight` of `shape`, loaded by `loader(param, loaded)`."""

    def __init__(
        self,
        shape: tuple[int, ...],
        loader: Callable[[nn.Parameter, torch.Tensor], None],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        numel = int(np.prod(shape))
        self.weight = nn.Parameter(
            torch.arange(numel, dtype=dtype).reshape(shape), requires_grad=False
        )
        self.loader = loader

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every tensor goes to `weight` through the scripted loader."""
        for _name, loaded in weights:
            self.loader(self.weight, loaded)
        return {"weight"}


#: The toy model's configuration most tests use.
CFG = ToyConfig()

#: The signed integer dtype of each element width, to view a tensor's bit patterns.
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns as integers (NaN and -0.0 compared exactly)."""
    return t.detach().contiguous().view(INT_OF_WIDTH[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
