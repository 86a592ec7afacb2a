"""Activation capture: read the residual stream at hook points and route it to consumer plugins."""
