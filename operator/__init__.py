"""moemesh.operator: the Kopf operator (handlers) and its pure decisions (autoscaler, EPLB)."""
