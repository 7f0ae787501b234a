"""The bottom of the builder core: the door to torch's private names, whole-tensor copies, seeded values."""
