"""The host-driven pipeline runtime: one program per stage on its own device (or sub-mesh),
placed by its arguments. `runtime.HostRuntime` runs a step as one program per device
(`column`, the messages inside the programs) where every stage has a device of its own, else
walks the schedule's table from the host (`walk`); `placement` says where each stage copy's
arrays live, `programs` holds the jitted and compiled stage programs, `state` converts the
training state to and from the single-device layout, `aot` compiles ahead of time,
`timeline` stamps one step's programs and `serial` times each action's programs alone."""
