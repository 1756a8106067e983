--[[ Shared by the scripts that need them; queues/scripts.py puts this file in front of each.
owns: the request hash says this worker holds this claim (the fence every worker write passes).
close: a request ends: it leaves the running set, gets its final status and reason, its last
event (if any) is appended, it is counted once in the metrics hash, and it is kept `ttl` s. ]]
local function owns(req, worker, claim_seq)
  local h = redis.call('HMGET', req, 'status', 'worker', 'claim_seq')
  return h[1] == 'running' and h[2] == worker and h[3] == claim_seq
end

local function close(running, req, out, metrics, id, status, now, ttl, completion_tokens, reason, event)
  redis.call('ZREM', running, id)
  redis.call('HSET', req, 'status', status, 'finished_ms', now,
    'completion_tokens', completion_tokens, 'finish_reason', reason)
  if #event > 0 then
    redis.call('XADD', out, '*', unpack(event))
  end
  local p = redis.call('HGET', req, 'priority') or '0'
  redis.call('HINCRBY', metrics, 'requests:' .. p .. ':' .. status, 1)
  if ttl > 0 then
    redis.call('EXPIRE', req, ttl)
    redis.call('EXPIRE', out, ttl)
  end
  return p
end
