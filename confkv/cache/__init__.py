"""The cache manager: each sequence's budget turned into block moves between the device pool and the host tier."""
