#!/usr/bin/env python3
"""flash-linear-attention's chunked linear attention at the shapes of
bench/cuda_forward.cpp, for scripts/gpu-check to print lina's time next to it.

    fla_forward.py [--shapes BxTxHxD,...] [--decode BxHxD|none] [--packed SxLxHxD,...|none]
                   [--retention BxTxHxD,...|none] [--no-backward] [--budget seconds] [--tsv file]

Per shape also forward + backward (unless --no-backward): autograd through
chunk_linear_attn with the mapped q, k and v as leaves and a random ∂o, timed
as one call; its ms go in the tsv's sixth column.

Times fla.ops.linear_attn.chunk_linear_attn(q, k, v, scale=1, normalize=True)
on bf16 tensors in fla's [B, T, H, D] layout (D = M), with CUDA events: the
median of repeated calls after three warm-up calls. The feature map (elu+1)
is applied to q and k beforehand and not timed: fla's op takes mapped
inputs, while lina's kernel applies the map itself — so the comparison
slightly favours fla. fla normalises with eps = 1e-5, lina with 1e-6.

--decode (default 64x32x128) also times one decode step of B sequences x H
heads: fla.ops.linear_attn.fused_recurrent_linear_attn on one token per
sequence ([B, 1, H, D]) from an fp32 state (kv [B, H, D, D], z [B, 1, H, D]),
normalize=True, output_final_state=True: what lina's cuda::recurrent step
does. Its tsv row has T = 1, as bench/cuda_forward's.

--packed (default 512x64x16x64,32x1024x16x128,4x8192x16x128) also times packed
sequences: S sequences of mean length L (sequence i has L//2 + (40503*i mod
(L+1)) rows, as bench/cuda_forward.cpp draws them) end to end in one batch row,
[1, sum, H, D], through chunk_linear_attn(..., cu_seqlens=offsets) (int64), forward
and forward + backward; its tsv rows have B = pS and T = L.

--retention (default 1x8192x96x128,8x2048x32x64) also times retention, lina's
causal(Q·Kᵀ, decay{0.96875})·V: fla.ops.simple_gla.chunk_simple_gla(q, k, v,
g_gamma=log(0.96875) on every head, scale=1) on unmapped bf16 q, k, v — what
fla's chunk_retention calls, with one decay for all heads instead of RetNet's
per-head ones (the kernels' work does not depend on the decays) — forward and
forward + backward; its tsv rows have B = rB, as bench/cuda_forward's.

--warmup calls each op once per shape (forward, forward + backward, the
decode step) and times nothing: Triton compiles fla's kernels into its cache
(TRITON_CACHE_DIR), over a minute per shape on a fresh machine, so that a
later timed run spends its time on the GPU. scripts/gpu-check runs it beside
lina's device tests.

Exits 3, printing why, when torch with CUDA or fla cannot be imported.
"""
import argparse
import inspect
import statistics
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x8192x96x128,2x16384x16x128,8x2048x32x64,8x1024x8x64")
    ap.add_argument("--decode", default="64x32x128")
    ap.add_argument("--packed", default="512x64x16x64,32x1024x16x128,4x8192x16x128")
    ap.add_argument("--retention", default="1x8192x96x128,8x2048x32x64")
    ap.add_argument("--no-backward", dest="backward", action="store_false",
                    help="skip forward + backward (autograd through chunk_linear_attn)")
    ap.add_argument("--budget", type=float, default=6.0, help="seconds of timed calls per shape, at most")
    ap.add_argument("--tsv", default="")
    ap.add_argument("--warmup", action="store_true", help="call each op once per shape, time nothing (Triton compiles)")
    args = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"fla is not available: torch cannot be imported ({e})")
        return 3
    if not torch.cuda.is_available():
        print("fla is not available: torch sees no CUDA device")
        return 3
    try:
        import fla
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as e:  # noqa: BLE001
        print(f"fla is not available: {e}")
        return 3

    params = inspect.signature(chunk_linear_attn).parameters
    kwargs = {"scale": 1.0, "normalize": True}
    if "head_first" in params:
        kwargs["head_first"] = False  # [B, T, H, D]

    print(f"fla {getattr(fla, '__version__', '?')}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}: chunk_linear_attn({', '.join(f'{k}={v}' for k, v in kwargs.items())})")
    print()
    if args.warmup:
        return warm(args, kwargs, chunk_linear_attn, torch, F)
    print("| B | T | H | D = M | reps | median ms (fla) | TFLOP/s |" + (" fwd+bwd ms (fla) |" if args.backward else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.backward else ""))
    tsv = open(args.tsv, "w") if args.tsv else None  # a row per shape as it finishes: a timeout keeps the done ones
    for text in args.shapes.split(","):
        b, t, h, d = (int(x) for x in text.split("x"))
        rand = uniform(torch, 1)
        q = F.elu(rand(b, t, h, d)) + 1
        k = F.elu(rand(b, t, h, d)) + 1
        v = rand(b, t, h, d)
        for _ in range(3):
            chunk_linear_attn(q, k, v, **kwargs)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        chunk_linear_attn(q, k, v, **kwargs)
        stop.record()
        torch.cuda.synchronize()
        first = start.elapsed_time(stop)
        reps = int(min(50, max(3, args.budget * 1e3 / max(first, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in events:
            s.record()
            chunk_linear_attn(q, k, v, **kwargs)
            e.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in events)
        flops = 4.0 * b * h * t * d * d
        both = ""
        if args.backward:
            both_ms = backward_ms(lambda x, y, z: chunk_linear_attn(x, y, z, **kwargs), q, k, v, rand(b, t, h, d),
                                  args.budget, torch)
            both = f" {both_ms:.3f} |"
        print(f"| {b} | {t} | {h} | {d} | {reps} | {ms:.3f} | {flops / (ms * 1e-3) / 1e12:.2f} |{both}", flush=True)
        if tsv:
            tsv.write(f"{b}\t{t}\t{h}\t{d}\t{ms:.6f}" + (f"\t{both_ms:.6f}" if args.backward else "") + "\n")
            tsv.flush()
        del q, k, v
        torch.cuda.empty_cache()
    if args.decode != "none":
        try:
            decode(args, tsv, torch)
        except Exception as e:  # noqa: BLE001 - the forward rows stand; say why the step has none
            print(f"\nfla decode step: failed: {e}")
    if args.packed != "none":
        try:
            packed(args, tsv, kwargs, chunk_linear_attn, torch, F)
        except Exception as e:  # noqa: BLE001 - the rows above stand; say why the packs have none
            print(f"\nfla packed sequences: failed: {e}")
    if args.retention != "none":
        try:
            retention(args, tsv, torch)
        except Exception as e:  # noqa: BLE001 - the rows above stand; say why retention has none
            print(f"\nfla retention: failed: {e}")
    if tsv:
        tsv.close()
    return 0


def warm(args, kwargs, chunk_linear_attn, torch, F):
    """--warmup: each op once per shape, nothing timed; a line per shape as it is done."""
    import time
    for text in args.shapes.split(","):
        t0 = time.monotonic()
        b, t, h, d = (int(x) for x in text.split("x"))
        q, k, v = (torch.rand(b, t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        chunk_linear_attn(q, k, v, **kwargs)
        if args.backward:
            ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
            torch.autograd.backward(chunk_linear_attn(ql, kl, vl, **kwargs)[0], torch.rand_like(v))
            del ql, kl, vl
        torch.cuda.synchronize()
        del q, k, v
        torch.cuda.empty_cache()
        print(f"warmed {text}: {time.monotonic() - t0:.0f} s", flush=True)
    if args.decode != "none":
        t0 = time.monotonic()
        budget, args.budget = args.budget, 0.0
        try:
            decode(args, None, torch)
        finally:
            args.budget = budget
        print(f"warmed the decode step {args.decode}: {time.monotonic() - t0:.0f} s", flush=True)
    if args.packed != "none":  # (last: the shapes and the step come first in gpu-check)
        for text in args.packed.split(","):
            t0 = time.monotonic()
            q, k, v, cu = pack_inputs(text, torch, F)
            chunk_linear_attn(q, k, v, cu_seqlens=cu, **kwargs)
            if args.backward:
                ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
                torch.autograd.backward(chunk_linear_attn(ql, kl, vl, cu_seqlens=cu, **kwargs)[0], torch.rand_like(v))
                del ql, kl, vl
            torch.cuda.synchronize()
            del q, k, v
            torch.cuda.empty_cache()
            print(f"warmed the pack {text}: {time.monotonic() - t0:.0f} s", flush=True)
    if args.retention != "none":
        from fla.ops.simple_gla import chunk_simple_gla
        for text in args.retention.split(","):
            t0 = time.monotonic()
            q, k, v, op = retention_inputs(text, chunk_simple_gla, torch)
            op(q, k, v)
            if args.backward:
                ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
                torch.autograd.backward(op(ql, kl, vl)[0], torch.rand_like(v))
                del ql, kl, vl
            torch.cuda.synchronize()
            del q, k, v
            torch.cuda.empty_cache()
            print(f"warmed retention {text}: {time.monotonic() - t0:.0f} s", flush=True)
    return 0


RETENTION_DECAY = 0.96875  # bench/cuda_forward.cpp's retention_decay


def retention_inputs(text, chunk_simple_gla, torch, seed=4):
    """q, k, v in [B, T, H, D] bf16 (unmapped) and the op: chunk_simple_gla with log(decay) on every head."""
    import math
    b, t, h, d = (int(x) for x in text.split("x"))
    rand = uniform(torch, seed)
    gamma = torch.full((h,), math.log(RETENTION_DECAY), device="cuda", dtype=torch.float32)
    def op(x, y, z):
        return chunk_simple_gla(x, y, z, g_gamma=gamma, scale=1.0)
    return rand(b, t, h, d), rand(b, t, h, d), rand(b, t, h, d), op


def retention(args, tsv, torch):
    """--retention: chunk_simple_gla with one decay on every head, forward and forward + backward."""
    from fla.ops.simple_gla import chunk_simple_gla
    print()
    print(f"fla retention: chunk_simple_gla(q, k, v, g_gamma=log({RETENTION_DECAY}) on every head, scale=1.0), "
          "[B, T, H, D] bf16")
    print()
    print("| B | T | H | D = M | reps | median ms (fla) | TFLOP/s |" + (" fwd+bwd ms (fla) |" if args.backward else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.backward else ""))
    for text in args.retention.split(","):
        b, t, h, d = (int(x) for x in text.split("x"))
        q, k, v, op = retention_inputs(text, chunk_simple_gla, torch)
        reps, ms = median_ms(lambda: op(q, k, v), args.budget, torch)
        both = ""
        if args.backward:
            both_ms = backward_ms(op, q, k, v, torch.rand_like(v), args.budget, torch)
            both = f" {both_ms:.3f} |"
        flops = 4.0 * b * h * t * d * d
        print(f"| {b} | {t} | {h} | {d} | {reps} | {ms:.3f} | {flops / (ms * 1e-3) / 1e12:.2f} |{both}", flush=True)
        if tsv:
            tsv.write(f"r{b}\t{t}\t{h}\t{d}\t{ms:.6f}" + (f"\t{both_ms:.6f}" if args.backward else "") + "\n")
            tsv.flush()
        q = k = v = None
        torch.cuda.empty_cache()


def uniform(torch, seed):
    """rand(*shape, dtype=bf16): uniform in [-1, 1) on the GPU, from a generator seeded with seed."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    def rand(*shape, dtype=torch.bfloat16):
        return torch.rand(*shape, device="cuda", generator=g, dtype=torch.float32).mul_(2).sub_(1).to(dtype)
    return rand


def backward_ms(op, q, k, v, do, budget, torch):
    """Median ms of op's forward + backward through autograd, q, k and v (mapped) as leaves, do as ∂o."""
    ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
    def train():
        torch.autograd.backward(op(ql, kl, vl)[0], do)
    return median_ms(train, budget, torch)[1]


def median_ms(f, budget, torch):
    """Median ms of repeated calls of f between CUDA events, after three warm-up calls."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    stop.record()
    torch.cuda.synchronize()
    reps = int(min(200, max(3, budget * 1e3 / max(start.elapsed_time(stop), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        f()
        e.record()
    torch.cuda.synchronize()
    return reps, statistics.median(s.elapsed_time(e) for s, e in events)


def pack_lengths(s, mean):
    """The pack's lengths, as bench/cuda_forward.cpp's lengths_of."""
    return [mean // 2 + (40503 * i) % (mean + 1) for i in range(s)]


def pack_inputs(text, torch, F, seed=3):
    """q, k (mapped: elu+1), v in [1, sum, H, D] bf16 and the int64 offsets (cu_seqlens) of an SxLxHxD pack."""
    s, mean, h, d = (int(x) for x in text.split("x"))
    lengths = pack_lengths(s, mean)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    rand = uniform(torch, seed)
    total = offsets[-1]
    q = F.elu(rand(1, total, h, d)) + 1
    k = F.elu(rand(1, total, h, d)) + 1
    v = rand(1, total, h, d)
    return q, k, v, torch.tensor(offsets, device="cuda", dtype=torch.int64)


def packed(args, tsv, kwargs, chunk_linear_attn, torch, F):
    """--packed: chunk_linear_attn over cu_seqlens, forward and forward + backward."""
    print()
    print("fla packed sequences: chunk_linear_attn(..., cu_seqlens=offsets), [1, sum, H, D] bf16")
    print()
    print("| S | L (mean) | sum | H | D = M | reps | median ms (fla) |" + (" fwd+bwd ms (fla) |" if args.backward else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.backward else ""))
    for text in args.packed.split(","):
        s, mean, h, d = (int(x) for x in text.split("x"))
        q, k, v, cu = pack_inputs(text, torch, F)
        reps, ms = median_ms(lambda: chunk_linear_attn(q, k, v, cu_seqlens=cu, **kwargs), args.budget, torch)
        both = ""
        if args.backward:
            both_ms = backward_ms(lambda x, y, z: chunk_linear_attn(x, y, z, cu_seqlens=cu, **kwargs), q, k, v,
                                  torch.rand_like(v), args.budget, torch)
            both = f" {both_ms:.3f} |"
        print(f"| {s} | {mean} | {q.shape[1]} | {h} | {d} | {reps} | {ms:.3f} |{both}", flush=True)
        if tsv:
            tsv.write(f"p{s}\t{mean}\t{h}\t{d}\t{ms:.6f}" + (f"\t{both_ms:.6f}" if args.backward else "") + "\n")
            tsv.flush()
        q = k = v = cu = None  # (freed before the next pack's)
        torch.cuda.empty_cache()


def decode(args, tsv, torch):
    from fla.ops.linear_attn import fused_recurrent_linear_attn
    b, h, d = (int(x) for x in args.decode.split("x"))
    rand = uniform(torch, 2)
    q = torch.nn.functional.elu(rand(b, 1, h, d)) + 1
    k = torch.nn.functional.elu(rand(b, 1, h, d)) + 1
    v = rand(b, 1, h, d)
    kv = rand(b, h, d, d, dtype=torch.float32).abs_()
    z = rand(b, 1, h, d, dtype=torch.float32).abs_().add_(1)
    def step():
        return fused_recurrent_linear_attn(q, k, v, scale=1.0, initial_state=(kv, z), output_final_state=True,
                                           normalize=True)
    reps, ms = median_ms(step, args.budget, torch)
    state_bytes = b * h * d * (d + 1) * 4
    print()
    print("fla decode step: fused_recurrent_linear_attn(scale=1.0, initial_state=(kv, z), "
          "output_final_state=True, normalize=True), one token per sequence")
    print()
    print("| sequences | H | D = M | reps | median µs per step (fla) | GB/s (state read + written) |")
    print("|---|---|---|---|---|---|")
    print(f"| {b} | {h} | {d} | {reps} | {ms * 1e3:.1f} | {2 * state_bytes / (ms * 1e-3) / 1e9:.0f} |", flush=True)
    if tsv:
        tsv.write(f"{b}\t1\t{h}\t{d}\t{ms:.6f}\n")
        tsv.flush()


if __name__ == "__main__":
    sys.exit(main())
