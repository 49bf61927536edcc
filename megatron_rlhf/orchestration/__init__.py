"""Ray single controller: the driver holds the loop, worker groups hold the models."""
