"""Delivery: how a filled slot reaches the client — doorbell frames for shm streams, batch
messages for both stream kinds."""
