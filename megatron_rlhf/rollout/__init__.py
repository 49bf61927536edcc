"""Rollout engines behind one protocol (:mod:`.base`), and the weight sync that feeds them."""
