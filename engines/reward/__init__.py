"""Rewards that need workers or services: reward models as worker groups, LLM judges, and their weighted sum."""
