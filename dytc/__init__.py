"""dytc: drafting and verification over dsia's levels: draft trees, lossless verification, the lookups, the
cascades and the DyTC router with its acceptance estimates and latency model."""
