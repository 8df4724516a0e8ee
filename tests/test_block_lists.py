"""The training kernels' second iteration source: per-block lists of partial and full blocks
(``attnbias.kernels.program.BlockLists``), built on the device (``attnbias.kernels.blocks``).

1. Every built-in bias run through block lists built from its materialized keep-mask gives
   the band path's result: output, log-sum-exp and every gradient (ALiBi slopes' included).
2. A block pattern no band describes (two separate key ranges per query block, a
   checkerboard, a query block that keeps nothing; lists shared or per batch row and head)
   against the fp64 oracle on the dense mask the pattern implies.
3. The builders against small examples worked out by hand, the packed form of a program with
   lists, and the registered op's autograd with every packed tensor present.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from in_turn import in_turn
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.backends import BACKENDS
from attnbias.kernels import attention_forward, block_sparse_attention, decode
from attnbias.kernels.blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    block_lists,
    block_lists_of_keep,
    block_lists_on_device,
    tile_states,
)
from attnbias.kernels.program import MaskProgram
from attnbias.spec import lower
from attnbias.testing.oracle import (
    assert_close_to_oracle,
    attention,
    flash_rounding,
    run_with_grads,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# list blocks: multiples of the 16 x 16 tiles of the interpreter, and of the GPU's tiles at 128
BLOCKS = [(16, 16), (32, 64), (64, 32)] if DEVICE == "cpu" else [(128, 128), (256, 128)]


def make_qkv(
    batch: int, heads: int, heads_kv: int, length_q: int, length_kv: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(batch * 1000 + length_q * 7 + length_kv)
    shapes = ((batch, heads, length_q, 16), (batch, heads_kv, length_kv, 16))
    q = torch.randn(*shapes[0], generator=generator)
    k, v = (torch.randn(*shapes[1], generator=generator) for _ in range(2))
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def program_keep(program: MaskProgram, length_q: int, length_kv: int) -> Tensor:
    """``(1 | B, 1, L, S)`` bool: the pairs a program's element terms keep (band, documents,
    key range), straight from their definitions."""
    i = torch.arange(length_q, device=DEVICE)[:, None]
    j = torch.arange(length_kv, device=DEVICE)[None, :]
    keep = torch.ones(1, 1, length_q, length_kv, dtype=torch.bool, device=DEVICE)
    if program.band_lo is not None:
        keep = keep & (j - i >= program.band_lo)
    if program.band_hi is not None:
        keep = keep & (j - i <= program.band_hi)
    if program.q_doc is not None and program.kv_doc is not None:
        q_doc = program.q_doc.reshape(-1, length_q)[:, None, :, None]
        kv_doc = program.kv_doc.reshape(-1, length_kv)[:, None, None, :]
        keep = keep & (q_doc == kv_doc)
    if program.kv_start is not None and program.kv_end is not None:
        start = program.kv_start.reshape(-1, 1, 1, 1)
        end = program.kv_end.reshape(-1, 1, 1, 1)
        keep = keep & (j >= start) & (j < end)
    return keep


def builtin_cases() -> dict[str, tuple[AttnBias, tuple[int, int, int, int, int]]]:
    """name -> (bias, (B, Hq, Hkv, L, S))."""
    docs_shared = DocumentBias.from_seqlens([20, 30, 23], device=DEVICE)
    q_ids = torch.tensor([[0] * 40 + [1] * 33, [0] * 10 + [1] * 50 + [2] * 13], device=DEVICE)
    docs_batch = DocumentBias(q_ids)
    return {
        "causal": (causal_upper_left(), (2, 2, 1, 73, 73)),
        "lower_right": (causal_lower_right(), (1, 2, 2, 50, 90)),
        "window": (causal_lower_right() + SlidingWindowBias(20), (2, 2, 1, 70, 90)),
        "documents": (docs_shared + causal_upper_left(), (2, 2, 1, 73, 73)),
        "documents_per_batch": (docs_batch, (2, 2, 2, 73, 73)),
        "key_range": (
            KeyRangeBias(start=[5, 0], end=[70, 33]) + causal_lower_right(),
            (2, 2, 1, 40, 80),
        ),
        "alibi": (AlibiBias(num_heads=4) + causal_upper_left(), (1, 4, 2, 64, 64)),
        "softcap": (SoftcapBias(3.0) + SlidingWindowBias(30, 10), (2, 2, 1, 60, 60)),
    }


def run(q: Tensor, k: Tensor, v: Tensor, program: MaskProgram, grad_out: Tensor) -> list[Tensor]:
    """``[out, lse, dq, dk, dv, dslopes]`` (``dslopes`` empty without ALiBi)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    slopes = program.alibi_slopes
    if slopes is not None:
        slopes = slopes.detach().clone().requires_grad_()
        program = program.replace(alibi_slopes=slopes)
    _, lse = attention_forward(q, k, v, program, scale=0.3)
    out = block_sparse_attention(*leaves, program, scale=0.3)
    sources = [*leaves] + ([slopes] if slopes is not None else [])
    grads = torch.autograd.grad(out, sources, grad_out)
    return [out.detach(), lse, *grads]


FP32_BF16 = ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))


def _builtin_runs() -> list[Any]:
    """Each built-in in float32 and bfloat16 on the GPU; on the CPU (each interpreted case costs
    10-15 s) one dtype per built-in, in turn (each dtype still runs, over half the cases)."""
    return [
        pytest.param(name, dtype, id=f"{name}-{label}")
        for name, dtype, label in in_turn(builtin_cases(), FP32_BF16, DEVICE == "cpu")
    ]


@pytest.mark.parametrize(("name", "dtype"), _builtin_runs())
def test_builtins_through_block_lists_match_the_band_path(name: str, dtype: torch.dtype) -> None:
    bias, (batch, heads, heads_kv, length_q, length_kv) = builtin_cases()[name]
    q, k, v = make_qkv(batch, heads, heads_kv, length_q, length_kv, dtype)
    grad_out = torch.randn_like(q)
    program = lower(bias, length_q, length_kv, q.device, batch=batch).program
    assert program.blocks is None
    band = run(q, k, v, program, grad_out)
    keep = program_keep(program, length_q, length_kv)
    tolerance = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    # on the CPU one of the three block shapes per case, in turn (each dtype at every shape
    # over the cases; each interpreted run costs seconds)
    index = list(builtin_cases()).index(name)
    shapes = BLOCKS if DEVICE != "cpu" else [BLOCKS[index % 3]]
    for block_m, block_n in shapes:
        lists = block_lists_of_keep(keep, block_m, block_n)
        listed = run(q, k, v, program.replace(blocks=lists), grad_out)
        names = ["out", "lse", "dq", "dk", "dv", "dslopes"]
        for what, got, want in zip(names, listed, band, strict=False):
            scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
            torch.testing.assert_close(
                got.float(), want.float(), rtol=0, atol=tolerance * scale, msg=what
            )


def pattern_keep(
    states: Tensor, block_m: int, block_n: int, length_q: int, length_kv: int
) -> Tensor:
    """The dense ``(Bl, Hl, L, S)`` keep-mask of a block pattern whose partial blocks keep
    every pair (no element terms): the listed blocks, cut to ``[0, L) x [0, S)``."""
    listed = (states > 0).repeat_interleave(block_m, -2).repeat_interleave(block_n, -1)
    return listed[..., :length_q, :length_kv]


def cut_edges(states: Tensor) -> Tensor:
    """``states`` with the blocks of the last block row and column (cut by L and S) at most
    partial, as a full block must lie inside the sequences."""
    states = states.clone()
    states[..., -1, :] = states[..., -1, :].clamp(max=PARTIAL)
    states[..., :, -1] = states[..., :, -1].clamp(max=PARTIAL)
    return states


def patterns(blocks_m: int, blocks_n: int) -> dict[str, Tensor]:
    """Block states ``(1, 1, Mb, Nb)`` no band describes."""
    rows = torch.arange(blocks_m)[:, None]
    cols = torch.arange(blocks_n)[None, :]
    two_ranges = (cols == 0) | (cols == rows + 2)  # a prefix block and one far to the right
    checker = (rows + cols) % 2 == 0
    hole = checker.clone()
    hole[1] = False  # query block 1 keeps nothing
    made = {}
    for name, listed in (("two_ranges", two_ranges), ("checkerboard", checker), ("hole", hole)):
        states = torch.where(listed, FULL, EMPTY).to(torch.int8)
        made[name] = cut_edges(states)[None, None]
    return made


def check_pattern(
    states: Tensor,
    block_m: int,
    block_n: int,
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
) -> list[Tensor]:
    """Run the lists of ``states`` on ``(B, Hq, Hkv, L, S)`` inputs against the fp64 oracle
    on the dense mask they imply; returns ``[out, dq, dk, dv]``."""
    batch, heads, heads_kv, length_q, length_kv = shape
    keep = pattern_keep(states, block_m, block_n, length_q, length_kv)
    program = MaskProgram(blocks=block_lists(states, block_m, block_n))
    q, k, v = make_qkv(batch, heads, heads_kv, length_q, length_kv, dtype)
    grad_out = torch.randn_like(q)
    oracle_bias = TensorBias(keep)
    got = run_with_grads(
        lambda *t: block_sparse_attention(*t, program, scale=0.3), (q, k, v), grad_out
    )
    expected = run_with_grads(
        lambda *t: attention(*t, oracle_bias, scale=0.3, enable_gqa=True), (q, k, v), grad_out
    )
    stock = run_with_grads(
        lambda *t: attention(*t, oracle_bias, scale=0.3, enable_gqa=True, dtype=dtype),
        (q, k, v),
        grad_out,
    )
    rounding = flash_rounding(q, k, v, oracle_bias, grad_out, scale=0.3)
    assert_close_to_oracle(got, expected, stock, dtype, ("out", "dq", "dk", "dv"), rounding)
    assert all(torch.isfinite(g).all() for g in got)
    return got


PATTERNS = ["two_ranges", "checkerboard", "hole"]


def _pattern_runs() -> list[Any]:
    """Each pattern at each block size in half precision and float32 on the GPU. On the CPU
    (each interpreted case of the larger blocks costs ~20-40 s) float32 at the first size only
    (the lists' indexing does not depend on the dtype), and half precision at the first and at
    one of the two larger sizes per pattern, in turn (each size still runs)."""
    runs = []
    for index, name in enumerate(PATTERNS):
        for dtype, label in ((torch.float32, "fp32"), (torch.float16, "fp16")):
            if DEVICE != "cpu":
                sizes = BLOCKS
            elif dtype == torch.float32:
                sizes = BLOCKS[:1]
            else:
                sizes = [BLOCKS[0], BLOCKS[1 + index % 2]]
            runs += [
                pytest.param(name, dtype, blocks, id=f"{name}-{label}-{blocks[0]}x{blocks[1]}")
                for blocks in sizes
            ]
    return runs


@pytest.mark.parametrize(("name", "dtype", "blocks"), _pattern_runs())
def test_a_block_pattern_no_band_describes(
    name: str, dtype: torch.dtype, blocks: tuple[int, int]
) -> None:
    block_m, block_n = blocks
    blocks_m, blocks_n = 5, 6
    length_q, length_kv = blocks_m * block_m - 3, blocks_n * block_n - 5
    states = patterns(blocks_m, blocks_n)[name].to(DEVICE)
    got = check_pattern(states, block_m, block_n, (2, 2, 1, length_q, length_kv), dtype)
    if name == "hole":  # rows that keep nothing: output 0, and no gradient from them
        rows = slice(block_m, 2 * block_m)
        assert (got[0][:, :, rows] == 0).all()
        assert (got[1][:, :, rows] == 0).all()


def _list_runs() -> list[Any]:
    """Each kind of lists in float32 and bfloat16 on the GPU; on the CPU one dtype per kind, in
    turn (each interpreted case costs 10-14 s)."""
    kinds = ["per_batch", "per_head", "per_batch_and_head"]
    return [
        pytest.param(kind, dtype, id=f"{label}-{kind}")
        for kind, dtype, label in in_turn(kinds, FP32_BF16, DEVICE == "cpu")
    ]


@pytest.mark.parametrize(("lists", "dtype"), _list_runs())
def test_lists_per_batch_row_and_head(lists: str, dtype: torch.dtype) -> None:
    """Each batch row or query head its own pattern (random partial, full and empty blocks),
    with two query heads per key/value head: the dK/dV kernel reads a list per query head."""
    block_m, block_n = BLOCKS[0]
    batch, heads, heads_kv, blocks_m, blocks_n = 2, 4, 2, 4, 5
    rows = batch if lists != "per_head" else 1
    cols = heads if lists != "per_batch" else 1
    generator = torch.Generator().manual_seed(11)
    states = torch.randint(0, 3, (rows, cols, blocks_m, blocks_n), generator=generator)
    states[-1, -1, 1] = EMPTY  # a query block that keeps nothing in the last (row, head)
    states = cut_edges(states.to(torch.int8)).to(DEVICE)
    length_q, length_kv = blocks_m * block_m - 5, blocks_n * block_n - 2
    shape = (batch, heads, heads_kv, length_q, length_kv)
    got = check_pattern(states, block_m, block_n, shape, dtype)
    hole = slice(block_m, 2 * block_m)
    assert (got[0][-1, -1, hole] == 0).all() and (got[1][-1, -1, hole] == 0).all()


def test_tile_states_and_lists_by_hand() -> None:
    # L = 5, S = 6 in blocks of 2 x 4: query blocks {0,1}, {2,3}, {4}; key blocks {0-3}, {4,5}
    keep = torch.zeros(1, 1, 5, 6, dtype=torch.bool)
    keep[0, 0, 0:2, 0:4] = True  # block (0, 0) whole: full
    keep[0, 0, 2, 1] = True  # block (1, 0) in part
    keep[0, 0, 4, 4:6] = True  # block (2, 1): every pair, but cut by L: partial
    states = tile_states(keep, 2, 4)
    assert states[0, 0].tolist() == [[FULL, 0], [PARTIAL, 0], [0, PARTIAL]]
    lists = block_lists(states, 2, 4)
    # (1, 1, Mb=3, 2, Nb + 1 = 3): [partial count, blocks...], [full count, blocks...]
    kv = lists.kv_lists[0, 0]
    assert [row[0][0].item() for row in kv] == [0, 1, 1]
    assert kv[1, 0, 1].item() == 0 and kv[2, 0, 1].item() == 1
    assert [row[1][0].item() for row in kv] == [1, 0, 0] and kv[0, 1, 1].item() == 0
    qv = lists.q_lists[0, 0]  # (Nb=2, 2, Mb + 1 = 4)
    assert qv[0, 0, 0].item() == 1 and qv[0, 0, 1].item() == 1  # key block 0: partial in 1
    assert qv[0, 1, 0].item() == 1 and qv[0, 1, 1].item() == 0  # and full in 0
    assert qv[1, 0, 0].item() == 1 and qv[1, 0, 1].item() == 2
    assert lists.kv_lists.dtype == lists.q_lists.dtype == torch.int32
    with pytest.raises(ValueError, match=r"\(Bl, Hl, L, S\) bool"):
        tile_states(keep[0], 2, 4)


@pytest.mark.parametrize("shape", [(1, 1, 3, 2), (2, 3, 5, 9), (1, 2, 33, 17), (1, 1, 1, 1)])
def test_lists_written_on_the_device_match_the_builder(shape: tuple[int, int, int, int]) -> None:
    """The list-writing kernel against :func:`block_lists`: each count and the blocks it
    counts, in both orientations (entries past a count are not read by the kernels)."""
    states = torch.randint(
        0, 3, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(7)
    )
    states[..., 0, 0] = FULL  # every state present in the small shapes too
    expected = block_lists(states, 16, 16)
    got = block_lists_on_device(states.to(DEVICE), 16, 16)
    for mine, theirs in ((got.kv_lists, expected.kv_lists), (got.q_lists, expected.q_lists)):
        mine = mine.cpu()
        assert mine.shape == theirs.shape and mine.dtype == torch.int32
        counts = theirs[..., 0]
        assert torch.equal(mine[..., 0], counts)
        listed = torch.arange(theirs.shape[-1] - 1) < counts[..., None]
        assert torch.equal(mine[..., 1:][listed], theirs[..., 1:][listed])


def test_a_program_with_lists_packs_and_unpacks() -> None:
    states = patterns(3, 4)["checkerboard"]
    lists = block_lists(states, 32, 16)
    slopes = torch.rand(1, 2)
    program = MaskProgram(band_lo=-5, band_hi=None, alibi_slopes=slopes, softcap=2.5, blocks=lists)
    tensors, ints, floats = program.pack()
    again = MaskProgram.unpack(tensors, ints, floats)
    assert (again.band_lo, again.band_hi, again.softcap) == (-5, None, 2.5)
    assert again.alibi_slopes is slopes and again.q_doc is None and again.kv_start is None
    assert again.blocks is not None
    assert (again.blocks.block_m, again.blocks.block_n) == (32, 16)
    assert again.blocks.kv_lists is lists.kv_lists and again.blocks.q_lists is lists.q_lists
    assert tensors[MaskProgram.tensor_slot("alibi_slopes")] is slopes
    assert MaskProgram.unpack(*MaskProgram().pack()).blocks is None


def test_list_blocks_must_be_powers_of_two_the_tiles_divide() -> None:
    q, k, v = make_qkv(1, 1, 1, 20, 20, torch.float32)
    states = torch.full((1, 1, 1, 1), PARTIAL, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="block_m=24"):
        attention_forward(q, k, v, MaskProgram(blocks=block_lists(states, 24, 32)), scale=1.0)


def test_the_decode_kernel_refuses_block_lists() -> None:
    q, k, v = make_qkv(1, 2, 1, 4, 40, torch.float32)
    states = torch.full((1, 1, 1, 3), PARTIAL, dtype=torch.int8, device=DEVICE)
    program = MaskProgram(blocks=block_lists(states, 16, 16))
    with pytest.raises(ValueError, match="block lists"):
        decode.plan_decode(q, k, v, program, scale=1.0)
    spec = attnbias.spec.make_spec(q, k, v, None, False, None, 0.0, True)

    class Listed:  # a spec whose program carries lists, as a bias lowering to lists will
        def __getattr__(self, name: str) -> object:
            return program if name == "program" else getattr(spec, name)

    reasons = BACKENDS["triton-decode"].not_supported_reasons(Listed())  # type: ignore[arg-type]
    assert any("block lists" in reason for reason in reasons)


def test_the_registered_op_with_every_packed_tensor_present() -> None:
    """Autograd looks into the op's tensor list only when it holds no None: the backward must
    then answer a gradient per tensor, and with a None in the list one for the whole list."""
    batch, heads, length_q, length_kv = 2, 2, 32, 48
    q, k, v = make_qkv(batch, heads, heads, length_q, length_kv, torch.float32)
    ids_q = torch.tensor([0] * 10 + [1] * 22, device=DEVICE)[None]
    ids_kv = torch.tensor([0] * 20 + [1] * 28, device=DEVICE)[None]
    keep = torch.ones(1, 1, length_q, length_kv, dtype=torch.bool, device=DEVICE)
    program = MaskProgram(
        band_hi=length_kv - length_q,
        q_doc=ids_q,
        kv_doc=ids_kv,
        kv_start=torch.tensor([0, 3], device=DEVICE),
        kv_end=torch.tensor([48, 40], device=DEVICE),
        alibi_slopes=torch.rand(1, heads, device=DEVICE),
        softcap=4.0,
        blocks=block_lists_of_keep(keep, 16, 16),
    )
    grad_out = torch.randn_like(q)
    for each in (program, program.replace(blocks=None)):
        tensors, ints, floats = each.pack()
        assert all(t is not None for t in tensors) == (each.blocks is not None)

        def through_op(*qkv: Tensor, packed: tuple = (tensors, ints, floats)) -> Tensor:
            return torch.ops.attnbias.attention_fwd(*qkv, *packed, 0.3)[0]

        def eager(*qkv: Tensor, program: MaskProgram = each) -> Tensor:
            return block_sparse_attention(*qkv, program, scale=0.3)

        got = run_with_grads(through_op, (q, k, v), grad_out)
        expected = run_with_grads(eager, (q, k, v), grad_out)
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_list_blocks_cut_by_the_sequences_end_read_nothing_past_it() -> None:
    """L = S = 80 is a whole number of 16-row tiles but not of 32 x 64 list blocks: the last
    listed blocks hold tiles past the queries' and the keys' end, which are never read (the
    inputs are views of buffers that hold NaN there), forward and backward."""
    length = 80
    inputs = make_qkv(1, 2, 2, length, length, torch.float32)
    grad_out = torch.randn_like(inputs[0])
    program = lower(causal_upper_left(), length, length, DEVICE, batch=1).program
    lists = block_lists_of_keep(program_keep(program, length, length), 32, 64)

    def results(padded: bool, program: MaskProgram) -> list[Tensor]:
        views = []
        for values in inputs:
            buffer = torch.full((1, 2, 96 if padded else length, 16), float("nan"))
            buffer[:, :, :length] = values
            views.append(buffer.to(DEVICE).requires_grad_()[:, :, :length])
        out = block_sparse_attention(*views, program, scale=0.3)
        return [out.detach(), *torch.autograd.grad(out, views, grad_out)]

    got = results(True, program.replace(blocks=lists))
    want = results(False, program)
    for what, a, b in zip(["out", "dq", "dk", "dv"], got, want, strict=True):
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=what)
