"""`conductorctl`, the operator's command line for a running conductor's gRPC admin API
(`conductorctl.cli`)."""
