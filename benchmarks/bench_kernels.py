"""MLA decode speed: the PyTorch reference on CPU, and the GPU kernels where there is a GPU.

Shape: DeepSeek-V3 attention (128 query heads, 576-wide keys, 512-wide values, bf16 pages of
64 tokens), one query token per sequence, 4K tokens of context, batch 1 to 16.

Rows (tokens/s = sequences decoded per second, one token each):

- ``reference_cpu_b{B}``: the reference decode on CPU. Its baseline is the same run's float32
  matmul rate turned into tokens/s (matmul GFLOP/s over the decode's FLOPs per token), so the
  ratio is the fraction of that roofline the reference reaches. Reported; no target.
- With CUDA: ``{flashmla,flashinfer}_gpu_b{B}`` against the reference on the same GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from common import Row, parse_args, time_median, write_result

# Run from a checkout without `pip install -e .` too (gpu_check.sh on a bare GPU machine).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tessera_ray.kernels import available_backends, mla_decode

HEADS = 128
HEAD_DIM = 576
HEAD_DIM_V = 512
PAGE = 64
CONTEXT = 4096
SCALE = 192**-0.5


def _flops_per_token(context: int) -> float:
    # scores (q . k over 576) and output (p . v over 512), two FLOPs per multiply-add
    return 2.0 * HEADS * context * (HEAD_DIM + HEAD_DIM_V)


def _inputs(batch: int, device: str, contiguous: bool = False) -> tuple[torch.Tensor, ...]:
    """Decode inputs over pool pages: a sequence's pages scattered over the pool as a pool
    hands them out (``contiguous``: each sequence's pages side by side, in order)."""
    gen = torch.Generator(device=device).manual_seed(batch)
    blocks = CONTEXT // PAGE
    k_cache = torch.randn(batch * blocks, PAGE, 1, HEAD_DIM, generator=gen, device=device)
    perm = torch.randperm(batch * blocks, generator=gen, device=device).to(torch.int32)
    if contiguous:
        perm = torch.arange(batch * blocks, device=device, dtype=torch.int32)
    table = perm.view(batch, blocks)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, generator=gen, device=device)
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device=device)
    return q.bfloat16(), k_cache.bfloat16(), table, lens


def _matmul_gflops(device: str, repeat: int) -> float:
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)

    def run() -> None:
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()

    return 2 * 1024**3 / time_median(run, repeat=repeat) / 1e9


def _decode_rate(
    batch: int, device: str, backend: str, repeat: int, contiguous: bool = False
) -> float:
    q, k_cache, table, lens = _inputs(batch, device, contiguous)
    if backend == "reference":
        q = q.float()  # the reference computes in float32 anyway; this is its natural input

    def run() -> None:
        mla_decode(q, k_cache, table, lens, SCALE, False, backend=backend)  # type: ignore[arg-type]
        if device == "cuda":
            torch.cuda.synchronize()

    return batch / time_median(run, repeat=repeat)


def main() -> None:
    args = parse_args("kernels")
    batches = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16)
    repeat = 3 if args.quick else 7
    rows: list[Row] = []
    gflops = _matmul_gflops("cpu", repeat=5 if args.quick else 15)
    roofline = gflops * 1e9 / _flops_per_token(CONTEXT)
    for batch in batches:
        rate = _decode_rate(batch, "cpu", "reference", repeat)
        rows.append(
            Row(
                name=f"reference_cpu_b{batch}",
                value=rate,
                unit="tokens/s",
                baseline="cpu_fp32_matmul_roofline",
                baseline_value=roofline,
                note=f"{HEADS} heads, {CONTEXT} context, bf16 pages; matmul {gflops:.1f} GFLOP/s",
            )
        )
    if torch.cuda.is_available():
        usable = available_backends()
        gpu_batches = (1, 16, 64) if args.quick else (1, 4, 16, 64, 128)
        for batch in gpu_batches:
            ref = _decode_rate(batch, "cuda", "reference", repeat)
            for backend in ("flashmla", "flashinfer"):
                if not usable[backend]:
                    continue
                rows.append(
                    Row(
                        name=f"{backend}_gpu_b{batch}",
                        value=_decode_rate(batch, "cuda", backend, repeat * 3),
                        unit="tokens/s",
                        baseline="reference_gpu",
                        baseline_value=ref,
                        note=f"{torch.cuda.get_device_name(0)}, {CONTEXT} context",
                    )
                )
        for backend in ("flashmla", "flashinfer"):
            if usable[backend]:
                # The pool's pages are where the pool put them; the kernel should not care.
                batch = gpu_batches[-1]
                rows.append(
                    Row(
                        name=f"{backend}_pool_vs_contiguous_b{batch}",
                        value=_decode_rate(batch, "cuda", backend, repeat * 3),
                        unit="tokens/s",
                        baseline="same_pages_contiguous",
                        baseline_value=_decode_rate(batch, "cuda", backend, repeat * 3, True),
                        target_ratio=0.95,
                        note=f"{torch.cuda.get_device_name(0)}, {CONTEXT} context",
                    )
                )
    write_result("kernels", args, rows)


if __name__ == "__main__":
    main()
