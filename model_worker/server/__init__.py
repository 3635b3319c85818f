"""The worker process: flags and start-up (`main`: load, compile the serving set, serve, compile the rest), the gRPC
servicer (`service`, thin: requests become `serving.sequence.Sequence`s for the engine loop) and the Prometheus
metrics. May import every room below it."""
