"""Importing this module turns on verl's fused-kernel backend "fgrpo" (our fused head) in this
process and registers our losses in verl's policy-loss registry: verl's
`actor_rollout_ref.model.external_lib=fgrpo_kernels.integrations.verl_enable` makes every worker
import it before the model is patched. See `fgrpo_kernels.integrations.verl` and
`fgrpo_kernels.integrations.verl_losses`.
"""

from .verl import use_fused_head
from .verl_losses import register_losses

use_fused_head()
register_losses()
