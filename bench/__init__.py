"""`jobsvc bench`: the service against standalone vLLM, in a package of its own. Workers never
import it; the bench attaches its probes to the workers it starts through their hooks
(`jobsvc.workers.hooks`)."""
