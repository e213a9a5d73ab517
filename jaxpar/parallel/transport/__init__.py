"""Moving arrays between processes: which devices a process holds and placing / fetching
global arrays (`processes`), point-to-point transfer servers (`transfers`), where a process is
reachable (`addresses`), and messages sent by compiled programs themselves (`p2p`, its C++ in
p2p.cc)."""
