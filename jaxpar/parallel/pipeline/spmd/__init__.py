"""The pipeline as one SPMD program over the STAGE axis: every stage a branch of `lax.switch`
over stages padded to one shape (`layout`), the schedule's slots a `lax.scan` with the
activations moved by `lax.ppermute` (`loops`), and the runtime that builds, places and
accounts for it (`runtime`)."""
