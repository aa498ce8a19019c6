"""Importing this module turns on verl's fused-kernel backend "fgrpo" (our fused head) in this
process: verl's `actor_rollout_ref.model.external_lib=fgrpo_kernels.integrations.verl_enable`
makes every worker import it before the model is patched. See `fgrpo_kernels.integrations.verl`.
"""

from .verl import use_fused_head

use_fused_head()
