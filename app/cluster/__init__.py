"""Sluice on Ray Serve: an ingress serving the app over engine replicas (needs the `ray` extra)."""
