"""fgrpo_kernels.integrations.verl without verl installed: `linear_cross_entropy` (verl's
signature on our head) against a float64 oracle on packed and padded inputs, gradients of both
outputs included; its named errors; a DTensor lm_head and verl's tensor-parallel
`dist_process_group` on 2 gloo ranks; the "fgrpo" backend's refusals, on a stand-in for verl's
monkey patch. tests/test_verl_head.py runs it inside verl itself."""

from __future__ import annotations

import pytest
import torch

from fgrpo_kernels.integrations import verl as fk_verl
from tests.ranks import run_ranks

V, H = 97, 13  # V not a multiple of any block, odd H


def _oracle(hidden, weight, labels, temperature):
    logits = (hidden.double() @ weight.double().T) / temperature
    logq = logits.log_softmax(-1)
    logp = logq.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, -(logq.exp() * logq).sum(-1)


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, shape, generator=g)
    return hidden, weight, labels


def _rel(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    "shape", [(1, 37), (37,), (3, 9), (1, 1)], ids=["rmpad", "flat", "padded", "one-token"]
)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_linear_cross_entropy_equals_float64(shape, temperature):
    hidden, weight, labels = _inputs(shape)
    a, b = torch.randn(shape), torch.randn(shape)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fk_verl.linear_cross_entropy(h, w, labels, temperature, "none")
    assert logp.shape == shape and ent.shape == shape
    assert logp.dtype == ent.dtype == torch.float32
    ((a * logp).sum() + (b * ent).sum()).backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_logp, want_ent = _oracle(h64, w64, labels, temperature)
    ((a.double() * want_logp).sum() + (b.double() * want_ent).sum()).backward()
    for label, got, want in [
        ("logp", logp, want_logp),
        ("entropy", ent, want_ent),
        ("dhidden", h.grad, h64.grad),
        ("dweight", w.grad, w64.grad),
    ]:
        err = _rel(got, want.detach())
        assert err < 1e-5, f"{label}: relative error {err:.3g}"


def test_entropy_gradient_alone_reaches_the_weight():
    hidden, weight, labels = _inputs((1, 20))
    w = weight.clone().requires_grad_()
    _, ent = fk_verl.linear_cross_entropy(hidden, w, labels, 1.0)
    ent.sum().backward()
    w64 = weight.double().requires_grad_()
    _oracle(hidden, w64, labels, 1.0)[1].sum().backward()
    assert _rel(w.grad, w64.grad) < 1e-5


def test_ignored_labels_give_zero_and_no_gradient():
    hidden, weight, labels = _inputs((1, 8))
    labels[0, 3] = -100
    h = hidden.clone().requires_grad_()
    logp, ent = fk_verl.linear_cross_entropy(h, weight, labels)
    (logp.sum() + ent.sum()).backward()
    assert logp[0, 3] == 0 and ent[0, 3] == 0
    assert not h.grad[0, 3].any() and h.grad[0, 2].any()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"reduction": "sum"}, ValueError, "reduction: expected 'none'"),
        ({"temperature": "0.7"}, TypeError, "temperature: expected a float"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"labels": torch.zeros(1, 5)}, TypeError, "labels: expected an integer tensor"),
        ({"labels": torch.zeros(1, 4, dtype=torch.long)}, ValueError, "labels: expected the shape"),
        ({"labels": torch.full((1, 5), V)}, ValueError, rf"targets: expected ids in \[0, {V}\)"),
        ({"weight": torch.randn(V, H + 1)}, ValueError, "weight"),
    ],
    ids=["reduction", "temperature-type", "temperature-zero", "float-labels", "shape", "vocab",
         "hidden-size"],
)  # fmt: skip
def test_named_errors(kwargs, error, match):
    hidden, weight, labels = _inputs((1, 5))
    args = {"hidden": hidden, "weight": weight, "labels": labels, **kwargs}
    with pytest.raises(error, match=match):
        fk_verl.linear_cross_entropy(**args)


# --------------------------------------------------------------- the "fgrpo" backend's seams


def _stand_in_patch(kernel):
    """verl's patch_forward_with_backends in miniature: backend "triton" installs a class forward
    that calls `kernel` (verl's module-level linear_cross_entropy)."""

    def patch(model, use_fused_kernels=False, fused_kernels_backend=None):
        assert fused_kernels_backend == "triton"

        def forward(self, hidden, labels):
            return kernel[0](hidden, self.weight, labels, 1.0, "none")

        model.__class__.forward = forward

    return patch


def _fake_model():
    cls = type("TinyLM", (), {})
    model = cls()
    model.weight = torch.randn(V, H)
    return model


def test_backend_answers_verls_kernel_with_ours_and_only_inside_its_forward():
    calls = []

    def verl_kernel(*args):
        calls.append("verl")
        return "verl's"

    kernel = [fk_verl._dispatch(verl_kernel)]
    model = _fake_model()
    fk_verl._with_our_backend(_stand_in_patch(kernel))(model, True, fk_verl.BACKEND)
    hidden, _, labels = _inputs((1, 6))
    logp, ent = model.forward(hidden, labels)
    want = fk_verl.linear_cross_entropy(hidden, model.weight, labels)
    assert torch.equal(logp, want[0]) and torch.equal(ent, want[1]) and not calls
    assert model._verl_fused_kernels_backend == fk_verl.BACKEND
    assert kernel[0](hidden, model.weight, labels) == "verl's"  # outside: verl's own
    assert calls == ["verl"]


def test_backend_refuses_without_use_fused_kernels():
    patch = fk_verl._with_our_backend(_stand_in_patch([None]))
    with pytest.raises(ValueError, match="use_fused_kernels: expected True"):
        patch(_fake_model(), False, fk_verl.BACKEND)


def test_backend_refuses_a_forward_that_never_reaches_the_head():
    def patch(model, use_fused_kernels=False, fused_kernels_backend=None):
        model.__class__.forward = lambda self, hidden, labels: hidden  # no log-probs

    model = _fake_model()
    fk_verl._with_our_backend(patch)(model, True, fk_verl.BACKEND)
    with pytest.raises(NotImplementedError, match="fused_kernels_backend: 'fgrpo' is not reached"):
        model.forward(torch.randn(1, 3, H), None)


def test_other_backends_pass_through_unchanged():
    seen = []
    patch = fk_verl._with_our_backend(lambda *args: seen.append(args))
    model = _fake_model()
    patch(model, True, "torch")
    assert seen == [(model, True, "torch")]


# ------------------------------------------------------------------- 2 gloo ranks (CPU)


def _distributed_ranks(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    hidden, weight, labels = _inputs((1, 23), seed=3)
    a, b = torch.randn(1, 23, generator=torch.Generator().manual_seed(4)), 0.5
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_logp, want_ent = _oracle(h64, w64, labels, 0.8)
    ((a * want_logp).sum() + (b * want_ent).sum()).backward()

    # (1) an FSDP2-style DTensor lm_head, sharded along the vocabulary over a 1-D mesh
    mesh = init_device_mesh("cpu", (world,))
    w_dt = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    h = hidden.clone().requires_grad_()
    logp, ent = fk_verl.linear_cross_entropy(h, w_dt, labels, 0.8)
    ((a * logp).sum() + (b * ent).sum()).backward()
    assert _rel(logp, want_logp.detach()) < 1e-5 and _rel(ent, want_ent.detach()) < 1e-5
    assert _rel(h.grad, h64.grad) < 1e-5
    # each rank holds the whole batch here, so the average over the ranks is the full gradient
    assert _rel(w_dt.grad.full_tensor(), w64.grad) < 1e-5

    # (2) verl's dist_process_group: equal shards, global labels, partial hidden gradients
    full = weight[: V - V % world]  # verl's kernel takes equal shards
    labels = labels % full.shape[0]
    h64, w64 = hidden.double().requires_grad_(), full.double().requires_grad_()
    want_logp, want_ent = _oracle(h64, w64, labels, 0.8)
    ((a * want_logp).sum() + (b * want_ent).sum()).backward()
    rows = full.shape[0] // world
    w = full[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    logp, ent = fk_verl.linear_cross_entropy(h, w, labels, 0.8, "none", dist.group.WORLD)
    ((a * logp).sum() + (b * ent).sum()).backward()
    assert _rel(logp, want_logp.detach()) < 1e-5 and _rel(ent, want_ent.detach()) < 1e-5
    dh = h.grad.clone()
    dist.all_reduce(dh)
    assert _rel(dh, h64.grad) < 1e-5, "the ranks' partial hidden gradients sum to the full one"
    assert _rel(w.grad, w64.grad[rank * rows : (rank + 1) * rows]) < 1e-5


def test_dtensor_weight_and_dist_process_group_on_two_ranks():
    run_ranks(_distributed_ranks, 2, torch_holds_group=True)
