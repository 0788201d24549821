"""Beyond one device: tensor-parallel process groups (parallel_state), the rank-0 -> followers input
broadcast, and the data-parallel controller that routes requests to replicas."""
