"""The data path without Lightning: shard streams and decoding, packing, the reordered sample stream, resumable
loaders, shard writers and converters (``omni_lightning.datamodules`` wraps it for Lightning)."""
