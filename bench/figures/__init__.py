"""The docs' images, made from the benchmarks' JSON or a running Prefect server."""
