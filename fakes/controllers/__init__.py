"""Stand-ins for the cluster controllers a real control plane runs and these machines cannot, each kept to what
its upstream counterpart does:

- `resourceclaims`: kube-controller-manager's resourceclaim controller (pkg/controller/resourceclaim): claims
  from ResourceClaimTemplates, reservedFor clean-up, deallocation once the last consumer is gone.
- `binder`: kube-scheduler binding ungated pods (node affinity, pre-allocated claims, reservedFor in PreBind).

    python -m fakes.controllers --kubeconfig F
"""

from fakes.controllers.binder import Binder
from fakes.controllers.resourceclaims import ResourceClaimController
from fakes.controllers.runner import Controllers

__all__ = ["Binder", "Controllers", "ResourceClaimController"]
