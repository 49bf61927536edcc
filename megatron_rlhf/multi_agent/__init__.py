"""Several actors trained in one run (``agents:`` in a PPO config): see :mod:`.driver`."""
