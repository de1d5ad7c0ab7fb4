"""The Ray Serve app (`app.build_app`: one Ingress, an ExpertShard deployment per shard group, the
StatusBoard). A request's path, in the order to read it:

1. Serve's HTTP proxy runs `proxy/`: `gate` (admission; `migration`: a broken stream sent again)
   and `router` (to the Ingress replica that took the prompt's prefix before).
2. `http_gate`: the API key, the body's size, the body read as JSON.
3. `ingress.Ingress`: the wiring (`__init__`), `reconfigure` (placement, API keys), the routes,
   which delegate to `openai.serving.OpenAIServing`.
4. `openai/`: `serving` (the request path: submit the choices, collect or stream them), the body
   parsed (`protocol`, `chat`), tokens to text (`text`, `reasoning`, `tools`), grammars
   (`structured`), the answer spelt (`render`) as typed models (`responses`).
5. `moe_workers.engine` (no Ray in it): `scheduler` plans a step, `runner` runs the layers (6, and 7
   for the experts) and samples, `scheduler.update` turns the tokens into outputs.
6. `moe_workers.model.dense`: embedding, attention, router, logits of a step.
7. `dispatch.ExpertDispatcher`: a MoE layer's rows to the shard groups that host their experts.
8. `moe_workers.transport`: the expert channel (`channel` at the Ingress, `server` at a shard).
9. `shard.ExpertShard` -> `expert_call.compute_call`: the experts' rows computed.
10. `moe_workers.store`: the tiered store holding those experts (hot, warm, cold).
"""
