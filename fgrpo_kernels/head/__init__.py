"""The fused linear head: `hidden @ weight.T` → log-probs (and entropy) without [N, V], its
autograd function and the public `fused_linear_logprobs`."""
