"""Our verl backend against verl's own Triton kernel (`verl.utils.kernel.linear_cross_entropy`)
on CUDA: log-probs, entropies and both gradients, bf16 lm_head inputs as verl runs them, packed
[1, N, H] and padded [B, T, H], with a temperature. Skipped without CUDA (this CPU machine); the
CPU comparisons with verl's torch backend are tests/test_verl_head.py."""

import pytest
import torch

from tests.verl_guard import need_verl

verl = need_verl()
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (verl's Triton kernel)"
)

H, V = 256, 4099  # an odd vocabulary: verl's and our tiles both see a ragged last tile


def reference(hidden, weight, labels, temperature):
    """float64 log-probs and entropies of softmax(h Wᵀ / τ)."""
    z = hidden.double() @ weight.double().T / temperature
    logp = z.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("shape", [(1, 333), (3, 97)], ids=["packed", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ours_equals_verls_triton_kernel(shape, temperature):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_lce

    from fgrpo_kernels.integrations.verl import linear_cross_entropy as ours

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(*shape, H, device="cuda", generator=gen).bfloat16()
    weight = (0.05 * torch.randn(V, H, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, V, shape, device="cuda", generator=gen)
    up_logp = torch.randn(shape, device="cuda", generator=gen)
    up_entropy = torch.randn(shape, device="cuda", generator=gen)
    ref_logp, ref_entropy = reference(hidden, weight, labels, temperature)

    results = []
    for fn in (ours, verl_lce):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        logp, entropy = fn(h, w, labels, temperature, "none")
        torch.autograd.backward((logp, entropy), (up_logp, up_entropy))
        results.append((logp.float(), entropy.float(), h.grad.float(), w.grad.float()))
    (logp, entropy, dh, dw), (v_logp, v_entropy, v_dh, v_dw) = results

    # ours is fp32-grade against float64 (bf16 products are exact in fp32)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    # verl's kernel: the same values to its fp32 accumulation; its gradients come back in bf16
    torch.testing.assert_close(logp, v_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, v_entropy, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dh, v_dh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw, v_dw, rtol=2e-2, atol=2e-2)
