"""torch.distributed on 2 CPU ranks (gloo), spawned by the tests: vocab-parallel log-probs and
losses equal the single-process result, FSDP2 DTensor lm_heads, global normalisers."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import fgrpo_kernels as fk
from fgrpo_kernels.backends import distributed

from .ranks import run_ranks

BACKENDS = ("cpp", "chunked", "triton")
RTOL = 1e-5


def _use(backend: str) -> None:
    """Select a backend for CPU tensors in this process (as the tests' FGRPO_* variables do)."""
    os.environ["FGRPO_BACKEND"] = "triton" if backend == "triton" else "cpu"
    os.environ["FGRPO_CPU_BACKEND"] = "torch" if backend == "chunked" else "cpp"


def rel(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def assert_close(label, got, want, rtol=RTOL):
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = rel(got, want)
    assert err <= rtol, f"{label}: relative error {err:.3g} > {rtol:g}"


def shard_bounds(V: int, rank: int, world: int) -> tuple[int, int]:
    """Uneven shards: rank 0 holds a third of the vocabulary (rounded down), rank 1 the rest."""
    cuts = [0, V // 3, V] if world == 2 else [round(V * r / world) for r in range(world + 1)]
    return cuts[rank], cuts[rank + 1]


@pytest.fixture(scope="module", autouse=True)
def _built_cpu_backend():
    fk.cpu_backend()  # build the C++ ops once here, not in every spawned rank


# ----------------------------------------------------------------------------- log-probs


def _logprob_ranks(rank, world):
    gen = torch.Generator().manual_seed(0)
    N, H, V = 23, 17, 61
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    bias = torch.randn(V, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -100
    targets[1] = V - 1
    targets[2] = 0
    g_logp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    lo, hi = shard_bounds(V, rank, world)
    for backend in BACKENDS:
        _use(backend)
        for with_bias, tau, reduce_dh in ((True, 0.7, True), (False, 1.0, False)):
            label = f"{backend} bias={with_bias} tau={tau} reduce_hidden_grad={reduce_dh}"
            b = bias if with_bias else None
            full = [t.clone().requires_grad_(True) if t is not None else None
                    for t in (hidden, weight, b)]  # fmt: skip
            lp, ent = fk.fused_linear_logprobs(
                full[0], full[1], targets, full[2], tau, return_entropy=True
            )
            ((lp * g_logp).sum() + (ent * g_ent).sum()).backward()
            part = [
                hidden.clone().requires_grad_(True),
                weight[lo:hi].clone().requires_grad_(True),
                None if b is None else b[lo:hi].clone().requires_grad_(True),
            ]
            vp = fk.VocabParallel(reduce_hidden_grad=reduce_dh)
            lp2, ent2 = fk.fused_linear_logprobs(
                part[0], part[1], targets, part[2], tau, return_entropy=True, vocab_parallel=vp
            )
            ((lp2 * g_logp).sum() + (ent2 * g_ent).sum()).backward()
            assert_close(f"{label} logp", lp2, lp)
            assert_close(f"{label} entropy", ent2, ent)
            dh = part[0].grad
            if not reduce_dh:
                dist.all_reduce(dh)
            assert_close(f"{label} dhidden", dh, full[0].grad)
            assert_close(f"{label} dweight", part[1].grad, full[1].grad[lo:hi])
            if b is not None:
                assert_close(f"{label} dbias", part[2].grad, full[2].grad[lo:hi])


def test_vocab_parallel_logprobs_equal_single_process():
    run_ranks(_logprob_ranks, 2)


def _layout_errors(rank, world):
    w = torch.randn(5 + rank, 3)
    h, y = torch.randn(4, 3), torch.tensor([0, 3, 7, 10])
    with pytest.raises(ValueError, match="vocab_parallel: expected the ranks' shards"):
        fk.fused_linear_logprobs(h, w, y, vocab_parallel=fk.VocabParallel(vocab_start=rank))
    with pytest.raises(ValueError, match="targets: expected ids in \\[0, 11\\)"):
        fk.fused_linear_logprobs(h, w, y + 1, vocab_parallel=fk.VocabParallel())
    explicit = fk.VocabParallel(vocab_start=0 if rank == 1 else 6)  # shards in swapped order
    out = fk.fused_linear_logprobs(h, w, y, vocab_parallel=explicit)
    assert torch.isfinite(out).all()


def test_vocab_parallel_layout_is_checked():
    run_ranks(_layout_errors, 2)


def test_vocab_parallel_needs_a_process_group():
    with pytest.raises(ValueError, match="vocab_parallel: expected an initialised"):
        fk.fused_linear_logprobs(
            torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]),
            vocab_parallel=fk.VocabParallel(),
        )  # fmt: skip


def _comm_volume(rank, world, out_path):
    N, H, V = 64, 8, 50
    lo, hi = shard_bounds(V, rank, world)
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H)[lo:hi].clone().requires_grad_(True)
    y = torch.randint(0, V, (N,))
    vp = fk.VocabParallel()
    fk.fused_linear_logprobs(h, w, y, vocab_parallel=vp)  # resolves the layout (cached)
    distributed.comm_bytes(reset=True)
    with torch.no_grad():
        fk.fused_linear_logprobs(h, w, y, vocab_parallel=vp)
    plain = distributed.comm_bytes(reset=True)
    assert plain == {"all_reduce": 3 * 4 * N}, plain  # max, sum-exp, logp
    lp, ent = fk.fused_linear_logprobs(h, w, y, return_entropy=True, vocab_parallel=vp)
    fwd = distributed.comm_bytes(reset=True)
    (lp.sum() + ent.sum()).backward()
    bwd = distributed.comm_bytes(reset=True)
    # forward: max, sum-exp, (logp, entropy) rows — 4·N fp32; backward: dhidden N·H fp32
    assert fwd == {"all_reduce": 4 * 4 * N}, fwd
    assert bwd == {"all_reduce": 4 * N * H}, bwd
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            f.write(f"{fwd} {bwd}")


def test_communication_is_o_n_per_call(tmp_path):
    run_ranks(_comm_volume, 2, str(tmp_path / "bytes.txt"))
    assert (tmp_path / "bytes.txt").read_text()


def _failing_rank(rank, world):
    if rank == 1:
        raise ValueError("boom from rank 1")


def test_the_rank_runner_reports_a_failing_rank():
    with pytest.raises(AssertionError, match="(?s)rank 1 failed.*boom from rank 1"):
        run_ranks(_failing_rank, 2, timeout=120)


# ----------------------------------------------------------------------------- FSDP2


def _fsdp_ranks(rank, world):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    gen = torch.Generator().manual_seed(1)
    N, H, V = 19, 12, 61  # 61 rows over 2 ranks: uneven shards (31 + 30)
    hiddens = [torch.randn(N, H, generator=gen) for _ in range(world)]
    targets = [torch.randint(0, V, (N,), generator=gen) for _ in range(world)]

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V)

        def forward(self, hidden, y):
            return self.logps(hidden, y)

        def logps(self, hidden, y):
            w, b = self.lm_head.weight, self.lm_head.bias
            return fk.fused_linear_logprobs(hidden, w, y, b, 0.9)

    torch.manual_seed(3)
    plain = Head()
    for p in plain.parameters():
        p.data.normal_()
    mesh = init_device_mesh("cpu", (world,))
    # reference: the unsharded model, gradients averaged over the ranks' batches (DDP)
    want_loss = fk.fused_linear_logprobs(
        hiddens[rank], plain.lm_head.weight, targets[rank], plain.lm_head.bias, 0.9
    ).sum()
    for h, y in zip(hiddens, targets):
        (plain(h, y).sum() / world).backward()

    # (1) the DTensor parameters passed as they are, outside any FSDP forward
    model = copy.deepcopy(plain)
    model.zero_grad(set_to_none=True)
    fully_shard(model, mesh=mesh)
    w, b = model.lm_head.weight, model.lm_head.bias
    assert distributed.is_dtensor(w) and distributed.is_dtensor(b)
    loss = fk.fused_linear_logprobs(hiddens[rank], w, targets[rank], b, 0.9).sum()
    loss.backward()
    assert_close("FSDP2 DTensor loss", loss.detach(), want_loss.detach())
    for name, p in (("weight", w), ("bias", b)):
        grad = p.grad
        assert distributed.is_dtensor(grad), f"{name}.grad is not a DTensor"
        assert tuple(grad.placements) == tuple(p.placements)
        want = getattr(plain.lm_head, name).grad
        assert_close(f"FSDP2 DTensor d{name}", grad.full_tensor(), want)

    # (2) a method registered as an FSDP forward: the parameters are unsharded plain tensors
    # inside it, and FSDP reduce-scatters their gradients
    model = copy.deepcopy(plain)
    model.zero_grad(set_to_none=True)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "logps")
    model.logps(hiddens[rank], targets[rank]).sum().backward()
    for name in ("weight", "bias"):
        grad = getattr(model.lm_head, name).grad
        want = getattr(plain.lm_head, name).grad
        assert_close(f"FSDP2 forward d{name}", grad.full_tensor(), want)


@pytest.mark.parametrize("backend", ["cpp"])
def test_fsdp2_dtensor_lm_head(backend, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    run_ranks(_fsdp_ranks, 2, torch_holds_group=True)  # FSDP2 (tests/ranks.py)


# ----------------------------------------------------------------------------- loss modules


def _module_cases(G):
    """(name, module factory taking the distributed options, call(module, hidden, weight, bias,
    ids, mask, batch)) for every fused module; `batch` holds the rest of the inputs."""

    def fgrpo(level, **kw):
        return lambda m, h, w, b, ids, mask, d: m(
            h, w, ids, mask, rewards=d["rewards"], ref_per_token_logps=d["ref"], bias=b
        )

    def grpo(m, h, w, b, ids, mask, d):
        return m(
            h, w, ids, mask, d["adv"], b, ref_per_token_logps=d["ref"],
            old_per_token_logps=d["old"],
        )  # fmt: skip

    def grpo_ref_hidden(m, h, w, b, ids, mask, d):  # the reference pass in the call
        return m(h, w, ids, mask, d["adv"], b, ref_hidden=d["ref_hidden"])

    def gift(m, h, w, b, ids, mask, d):
        return m(h, w, ids, mask, d["rewards"], d["ref"], bias=b)

    def fdo(m, h, w, b, ids, mask, d):
        return m(h, w, ids, mask, d["chosen"], d["ref"], bias=b)

    def fhal(m, h, w, b, ids, mask, d):
        return m(
            h, w, ids, mask, h, ids, mask, d["chosen"], rewards=d["rewards"],
            ref_per_token_logps=d["ref"], pref_ref_per_token_logps=d["ref"], bias=b,
        )  # fmt: skip

    return [
        ("fgrpo_token", lambda **o: fk.FusedLinearFGRPOLoss(
            "js", 0.5, "token", num_generations=G, temperature=0.8, entropy_coef=0.01, **o),
         fgrpo("token")),
        ("fgrpo_sequence_batch", lambda **o: fk.FusedLinearFGRPOLoss(
            "kl", 0.1, "sequence", num_generations=G, scale_rewards="batch", **o),
         fgrpo("sequence")),
        ("grpo_dapo_entropy", lambda **o: fk.FusedLinearGRPOLoss(
            "dapo", 0.04, temperature=0.8, entropy_coef=0.01, top_entropy_quantile=0.5, **o),
         grpo),
        ("grpo_grpo_sequence", lambda **o: fk.FusedLinearGRPOLoss(
            "grpo", 0.04, importance_sampling_level="sequence", **o), grpo),
        ("grpo_dr_grpo", lambda **o: fk.FusedLinearGRPOLoss("dr_grpo", 0.0, **o), grpo),
        ("grpo_ref_hidden", lambda **o: fk.FusedLinearGRPOLoss("dapo", 0.1, **o),
         grpo_ref_hidden),
        ("gift", lambda **o: fk.FusedLinearGIFTLoss(2, 1.0, **o), gift),
        ("fdo", lambda **o: fk.FusedLinearFDOLoss("pearson", 0.2, **o), fdo),
        ("fhal", lambda **o: fk.FusedLinearFHALLoss("js", 0.2, 0.3, num_generations=G, **o),
         fhal),
    ]  # fmt: skip


def _batch(B, T, H, V, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[1, T - 2 :] = 0
    mask[-1, 3:] = 0
    return {
        "hidden": torch.randn(B, T, H, generator=gen),
        "ref_hidden": torch.randn(B, T, H, generator=gen),
        "weight": torch.randn(V, H, generator=gen) * 0.3,
        "bias": torch.randn(V, generator=gen) * 0.1,
        "ids": torch.randint(0, V, (B, T), generator=gen),
        "mask": mask,
        "rewards": torch.rand(B, generator=gen),
        "adv": torch.randn(B, generator=gen),
        "ref": -torch.rand(B, T, generator=gen) * 3 - 2,
        "old": -torch.rand(B, T, generator=gen) * 3 - 2,
        "chosen": torch.arange(B) % 3 == 0,
    }


def _run_module(make, call, d, rows, weight, bias, **opts):
    h = d["hidden"][rows].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    sub = {k: (v[rows] if k not in ("weight", "bias") else v) for k, v in d.items()}
    module = make(**opts)
    loss = call(module, h, w, b, sub["ids"], sub["mask"], sub)[0]
    loss.backward()
    passes = [m.last_pass for m in module.modules() if hasattr(m, "last_pass")]
    return loss.detach(), h.grad, w.grad, b.grad, passes


def _vocab_parallel_modules(rank, world):
    d = _batch(6, 7, 11, 53, seed=5)
    lo, hi = shard_bounds(53, rank, world)
    every = slice(None)
    for backend in ("cpp", "triton"):
        _use(backend)
        for name, make, call in _module_cases(G=3):
            want = _run_module(make, call, d, every, d["weight"], d["bias"])
            got = _run_module(
                make, call, d, every, d["weight"][lo:hi], d["bias"][lo:hi],
                vocab_parallel=fk.VocabParallel(),
            )  # fmt: skip
            label = f"{backend} {name} vocab-parallel"
            assert_close(f"{label} loss", got[0], want[0])
            assert_close(f"{label} dhidden", got[1], want[1])
            assert_close(f"{label} dweight", got[2], want[2][lo:hi])
            assert_close(f"{label} dbias", got[3], want[3][lo:hi])
            # the single pass needs every shard's logits for a chunk's lse: two-pass here
            assert all(p.startswith("two-pass: vocab_parallel") for p in got[4]), (label, got[4])


def test_every_module_vocab_parallel_equals_single_process():
    run_ranks(_vocab_parallel_modules, 2, timeout=600)


def _data_parallel_modules(rank, world):
    B = 8  # 4 completions per rank
    d = _batch(B, 6, 9, 31, seed=7)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    group = dist.group.WORLD
    _use("cpp")
    passes = []
    # f-GRPO with G = 8 > rows per rank: every group straddles the ranks; GIFT needs whole
    # groups (G = 2); the others take any split
    for name, make, call in _module_cases(G=8):
        want = _run_module(make, call, d, slice(None), d["weight"], d["bias"])
        got = _run_module(make, call, d, rows, d["weight"], d["bias"], process_group=group)
        mean = got[0].clone()
        dist.all_reduce(mean)
        label = f"{name} data-parallel"
        assert_close(f"{label} mean loss over ranks", mean / world, want[0])
        # DDP averages gradients over the ranks: (1/world)·Σ_r ∇loss_r = ∇(batch loss)
        for what, g, w in (("dweight", got[2], want[2]), ("dbias", got[3], want[3])):
            g = g.clone()
            dist.all_reduce(g)
            assert_close(f"{label} {what}", g / world, w)
        assert_close(f"{label} dhidden of this rank's rows", got[1] / world, want[1][rows])
        passes.append((name, got[4]))
    # the single pass runs under data parallelism (global normalisers and advantages are
    # computed before its sweep); the entropy mask's quantile keeps GRPO on the two-pass path
    for name, got in passes:
        want = ["two-pass" if name == "grpo_dapo_entropy" else "single"] * len(got)
        assert [p.split(":")[0] for p in got] == want, (name, got)


def test_every_module_data_parallel_equals_the_whole_batch():
    run_ranks(_data_parallel_modules, 2, timeout=600)


def _readme_example(rank, world, source):
    _use("cpp")
    exec(compile(source, "README.md distributed example", "exec"), {})


def test_readme_distributed_example_runs_on_two_ranks():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (source,) = re.findall(r"<!-- distributed-example -->\n```python\n(.*?)```", readme, re.S)
    run_ranks(_readme_example, 2, source)


def _fresh_process_calls(rank, world):
    import sys

    # the C++ ops load during the calls below, after init_process_group (they used to import
    # torch._dynamo and with it torch.distributed.nn): tests/ranks.py then checks the group is gone
    assert "torch.distributed.nn.functional" not in sys.modules
    assert "fgrpo_kernels.backends.cpu.cpp" not in sys.modules
    _use("cpp")
    group = dist.new_group([0, 1])  # an explicit group: the vocab-parallel layout cache's key
    d = _batch(4, 5, 7, 29, seed=2)
    lo, hi = shard_bounds(29, rank, world)
    _, make, call = _module_cases(G=2)[2]  # GRPO dapo with the entropy terms
    _run_module(
        make, call, d, slice(None), d["weight"][lo:hi], d["bias"][lo:hi],
        vocab_parallel=fk.VocabParallel(group=group),
    )  # fmt: skip
    rows = slice(rank * 2, rank * 2 + 2)
    _run_module(make, call, d, rows, d["weight"], d["bias"], process_group=group)
    dist.destroy_process_group(group)


def test_regression_fused_calls_never_hold_the_process_group():
    """The C++ backend's first load imported torch._dynamo, whose import of
    torch.distributed.nn.functional after init_process_group held the default group past
    destroy_process_group (default arguments group=group.WORLD); its gloo threads then aborted
    one rank in six at interpreter exit. The vocab-parallel layout cache held explicit groups."""
    run_ranks(_fresh_process_calls, 2)
