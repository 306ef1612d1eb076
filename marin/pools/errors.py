"""How a pool launch fails: the errors the launcher raises, and the one a host raises to stop it."""

from __future__ import annotations

from marin.execution.failures import InfrastructureFailure


class NonRetryableError(RuntimeError):
    """A failure a retry cannot fix (e.g. divergence): the launcher stops at once and re-raises it."""


class PoolLaunchError(RuntimeError):
    """The pool failed on every allowed attempt."""


class HostOutOfMemory(PoolLaunchError):
    """Ray's memory monitor killed a host because its node ran low on host memory. Not retried: the
    same program on the same nodes needs the same memory."""


class PoolLostError(PoolLaunchError, InfrastructureFailure):
    """Every allowed attempt of the pool ended in an infrastructure failure (a host died, a peer went
    away, the pool stalled): the executor retries the step by itself, from its last checkpoint."""



class PoolInfeasibleError(PoolLaunchError):
    """No node of the cluster can ever hold the pool's placement (it asks for more than any node, or
    more nodes than there are): a step error, not retried."""


class RendezvousFailed(InfrastructureFailure):
    """A host could not join the pool's start-up rendezvous (its coordinator or a peer did not answer)."""


class RendezvousError(PoolLostError):
    """The pool's hosts did not all join the start-up rendezvous on any attempt its
    ``rendezvous_retries`` allowed; the message names the hosts that never joined."""
