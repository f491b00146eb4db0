"""The parts of one engine step, each in its own file: the plain step and the overlapped one, the
forking of n choices, constrained requests' masks and grammars, and speculation."""
