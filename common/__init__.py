"""What the three services share, below all of them: where services listen and how they connect (`network`), model
preparation (`preparation`), the metrics' shared buckets (`telemetry`), the model-family registry (`families`)
and JSON-object prefixes (`json_prefix`). Nothing here imports a service, a family plug-in or the launcher."""
