-- Argo CD health check for kvfleet.dev/InferenceService.
-- Reads only status.conditions and observedGeneration, so the verdict is about the spec Argo CD
-- just synced, not an older one the operator finished with before the last commit.
local hs = {}

local function condition(conditions, type_name)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == type_name then
      return c
    end
  end
  return nil
end

-- A condition's own observedGeneration wins over status.observedGeneration: it says which spec
-- that particular verdict was reached for.
local function observed(status, c)
  if c ~= nil and c.observedGeneration ~= nil then
    return c.observedGeneration
  end
  return status.observedGeneration
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to report status"
  return hs
end

local status = obj.status
local generation = obj.metadata.generation
local conditions = status.conditions

if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on generation " .. tostring(generation)
  return hs
end

-- The reason leads the message: it is the key of docs/troubleshooting.md (Unschedulable,
-- ImagePullFailed, CrashLoop, OOMKilled, ModelDownloadFailed, InvalidSpec...).
local degraded = condition(conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  if degraded.reason ~= nil and degraded.message ~= nil and degraded.message ~= "" then
    hs.message = degraded.reason .. ": " .. degraded.message
  else
    hs.message = degraded.message or degraded.reason or "InferenceService is degraded"
  end
  return hs
end

local ready = condition(conditions, "Ready")
local progressing = condition(conditions, "Progressing")

if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = progressing.message or progressing.reason or "Rolling out"
  return hs
end

-- Zero replicas, once the operator has seen that spec, is one of two states, neither a rollout
-- that never ends:
-- * scale to zero (autoscaling on, minReplicas 0, the kvfleet router in front): the autoscaler
--   removed the last replica of an idle service, and the router's activator starts one for the
--   next request without anyone acting. The
--   service works as designed, so Healthy (idle): Suspended would hold up sync waves and alert
--   on every quiet night.
-- * spec.replicas 0, or no router to wake it: nothing will answer until someone acts.
--   Suspended, as Argo CD shows a suspended CronJob or a paused Rollout.
local function scales_to_zero(spec)
  if spec == nil or spec.autoscaling == nil or spec.router == nil then
    return false
  end
  local router = spec.router.enabled == true and (spec.router.mode == nil or spec.router.mode == "kvfleet")
  return router and spec.autoscaling.enabled == true and spec.autoscaling.minReplicas == 0
end

if ready ~= nil and ready.status == "False" and ready.reason == "ScaledToZero" then
  local seen = observed(status, ready)
  if seen ~= nil and (generation == nil or seen == generation) then
    if scales_to_zero(obj.spec) then
      hs.status = "Healthy"
      hs.message = "Idle, scaled to zero (" .. (ready.message or "no requests") .. ")"
      return hs
    end
    hs.status = "Suspended"
    hs.message = "Scaled to zero replicas (" .. (ready.message or "spec.replicas is 0") .. ")"
    return hs
  end
end

if ready ~= nil and ready.status == "True" then
  local seen = observed(status, ready)
  if seen ~= nil and (generation == nil or seen == generation) then
    hs.status = "Healthy"
    hs.message = ready.message or "Ready"
    return hs
  end
  hs.status = "Progressing"
  hs.message = "Ready was reported for generation " .. tostring(seen) .. ", waiting for generation " .. tostring(generation)
  return hs
end

hs.status = "Progressing"
if ready ~= nil and ready.message ~= nil then
  hs.message = ready.message
else
  hs.message = "Waiting for the InferenceService to become Ready"
end
return hs
