"""Operator tools: the one-shot migration of legacy turn documents (`python -m migrations`)."""
