"""The backends: ``cuda`` (the driver's entry points, chosen once) and ``host`` (an emulated
device for machines without a GPU, and CI). Each implements the protocols the core declares
(``deviceop._core._base``: streams, buffers, the driver table); the core's device selection
makes them."""
