"""Rollout layer: the generate protocol and the engines behind it."""
