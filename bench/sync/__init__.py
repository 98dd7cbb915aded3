"""Weight sync between real processes without Ray (the device machines have none): the transports of
engines/sync over a process worker group, and SGLang's distributed weight update against the raw link."""
