"""prefect.yaml and the recipes, installed as package data: `rlflow init` copies them into a project directory."""
