"""Runtime plumbing beneath the loop: many processes (`distributed`: jax.distributed and MPI
start-up, pinning, the job-wide abort hook), gloo's network thread made to give way
(`gloo_poller`), glibc's malloc told to keep freed memory (`host_memory`), C++ sources built
on first use (`native`), and optional dependencies imported with one message (`optional`)."""
