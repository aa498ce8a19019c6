"""A new loss family in one file, through the pipeline (docs/architecture.md, "To add a loss").

The toy family: L = −Σ_i c_i · Σ_t m_it·logp_it / max(Σ m, 1), per-row weights c [B]. Its step
gives the two-pass epilogue (plain torch on the fused log-probs) and a single-pass
`ChunkedLoss` (token locality: the normaliser is counted up front). Both paths equal plain
torch on the [N, V] logits in float64, on the CPU backends and on the Triton interpreter."""

import pytest
import torch

from fgrpo_kernels.backends.cpu import cpp
from fgrpo_kernels.losses import single_pass
from fgrpo_kernels.losses.pipeline import FusedLoss, LossStep


class ToyStep(LossStep):
    def __init__(self, batch, weights):
        self.mask, self.c = batch.mask, weights.detach()
        self.scale = 1.0 / batch.mask.sum().clamp(min=1.0)

    def two_pass(self, logps, entropy):
        return -(self.c[:, None] * self.mask * logps).sum() * self.scale

    def chunked(self):
        def grad(rows, m, lp, ent):
            return -(self.c[rows, None] * m).to(lp.dtype) * self.scale, None

        return single_pass.ChunkedLoss(single_pass.Locality.TOKEN, grad, self.loss)

    def loss(self, logps, entropy):
        return self.two_pass(logps, entropy).detach()

    def metrics(self, loss, logps, entropy):
        return {"toy/mean_logp": (logps * self.mask).sum().detach() * self.scale}


class FusedLinearToyLoss(FusedLoss):
    def forward(self, hidden, weight, completion_ids, completion_mask, weights, bias=None):
        batch = self.batch(hidden, weight, completion_ids, completion_mask, bias)
        return self.run(batch, ToyStep(batch, weights))


def toy_reference(h, w, ids, mask, c):
    logp = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0]
    return -(c[:, None] * mask * logp).sum() / mask.sum().clamp(min=1.0)


@pytest.fixture(params=["chunked", "cpp", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton" if request.param == "triton" else "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch" if request.param == "chunked" else "cpp")
    monkeypatch.delenv("FGRPO_MAX_CHUNK_BYTES", raising=False)
    if request.param == "cpp" and not cpp.available():
        pytest.skip(f"C++ backend not built: {cpp.build_error()}")
    return request.param


@pytest.mark.parametrize("max_chunk_bytes, path", [(None, "single"), (0, "two-pass")])
def test_toy_family_equals_plain_torch(backend, max_chunk_bytes, path):
    gen = torch.Generator().manual_seed(7)
    B, T, H, V = 3, 5, 12, 37
    h = torch.randn(B, T, H, generator=gen, requires_grad=True)
    w = torch.randn(V, H, generator=gen, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[1, 2:] = 0
    mask[2] = 0  # an empty row
    c = torch.tensor([1.0, -0.5, 2.0])
    module = FusedLinearToyLoss(max_chunk_bytes=max_chunk_bytes)
    loss, metrics = module(h, w, ids, mask, c)
    loss.backward()
    assert module.last_pass.startswith(path), module.last_pass
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = toy_reference(h64, w64, ids, mask, c.double())
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)
    assert set(metrics) == {"toy/mean_logp"}


def test_toy_family_takes_the_heads_options():
    module = FusedLinearToyLoss(temperature=2.0)
    assert module.temperature == 2.0 and module.head.temperature == 2.0
    module.max_chunk_bytes = 0
    assert module.head.max_chunk_bytes == 0
    with pytest.raises(TypeError, match="^chunk_bytes: not an option of the fused head"):
        FusedLinearToyLoss(chunk_bytes=1)
    with pytest.raises(ValueError, match="^max_chunk_bytes: expected"):
        module.max_chunk_bytes = -1
