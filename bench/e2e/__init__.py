"""The RL loop end to end: the bare loop (no Prefect, no Ray; the baseline and the first debugging tool), GRPO per
placement and staleness, sync against one-step-off, and a GPU worker killed mid-step then resumed."""
