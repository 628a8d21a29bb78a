"""What both worker roles share: the engine wrapper, the gRPC servicer, the process main."""
