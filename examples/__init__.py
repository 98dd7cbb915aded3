"""Example rollout functions (named by import path in a recipe's rollout.fn)."""
