"""The JAX engine: it owns the weights, the KV cache and the penalty state on the device and runs a fixed grid of
compiled programs (`engine`, `programs`), compiled in the background while serving (`background_compile`), kept in
the executable cache (`executables`), sized to the device's memory (`memory`), split over devices (`sharding`). It
implements `serving.engine_api.Engine`. May import modeling, numerics and serving's contract records; never the
server."""
