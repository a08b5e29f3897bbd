"""Entry point: ``kopf run -m moemesh.operator.main --all-namespaces`` (or ``--namespace=NS``).

Importing this module registers the operator's handlers into kopf's default registry with the
configuration from the environment (see ``moemesh.operator.config``).
"""

import kopf

from moemesh.operator.config import OperatorConfig
from moemesh.operator.handlers import register

register(kopf.get_default_registry(), OperatorConfig.from_env())
