"""The engine replicas' router Ray Serve built in this process, found by application.

Ray Serve builds each handle's request router itself, from a copy of app/cluster/router.py's class (pickled
by value), so an ingress cannot reach the one its handle routes with through that class: the router enters
itself here, in a module imported by name, and the ingress's ReplicaPool reads /health's and /metrics's
figures from it.
"""

from __future__ import annotations

import weakref
from typing import Any

_routers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(app_name: str, router: Any) -> None:
    _routers[app_name] = router


def router_of(app_name: str) -> Any | None:
    """The CacheAwareRouter of `app_name`'s engine replicas in this process, once one was built."""
    return _routers.get(app_name)
