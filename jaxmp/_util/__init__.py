"""Small helpers every layer shares: formatting, atomic files, the XLA environment, array sizes,
messages.

``fmt``, ``io`` and ``env`` import no jax (the CLI uses them before the backend may start);
``arrays`` and ``log`` do.
"""
