--[[ requeue: a claimed request goes back to waiting in its original place (same member and the
score it was enqueued with: same sequence number, priority and, with aging, arrival), and
whoever claims it next resumes after what its stream holds.
Moves: running -> waiting, running -> failed, running -> cancelled
Three callers: any worker, for a claim whose lease ran out (its worker died or froze); a worker
stopping cleanly, for its own claims; a worker that knows another on its host died (dead pid).
KEYS: running zset, waiting zset, request hash, output stream, metrics hash
ARGV: request id, now (ms), most claims a request may lose (0 = no limit), retention (s) of a
  request that ends here, owner ('' = only if its lease ran out; else the worker that must hold
  it now), the claim_seq that owner must hold ('' = any of its claims), lost ('1' when the
  claim was lost (its worker died), '0' when handed back cleanly)
Returns (RequeueResult) REQUEUED, ENDED: failed (it lost too many claims: worker_lost) or
cancelled (its client asked while its worker was gone), or NOTHING to do (lease renewed, not
that owner, or already ended). ]]
local running, waiting, req, out, metrics = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, now, most_lost, ttl, owner, claim_seq, lost = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local NOTHING, REQUEUED, ENDED = 0, 1, 2

if owner == '' then
  local deadline = redis.call('ZSCORE', running, id)
  if not deadline or tonumber(deadline) > tonumber(now) then
    return NOTHING
  end
else
  local h = redis.call('HMGET', req, 'status', 'worker', 'claim_seq')
  if h[1] ~= 'running' or h[2] ~= owner or (claim_seq ~= '' and h[3] ~= claim_seq) then
    return NOTHING
  end
end
if redis.call('HGET', req, 'status') ~= 'running' then
  redis.call('ZREM', running, id)
  return NOTHING
end
local times_lost = 0
if owner == '' or lost == '1' then
  times_lost = redis.call('HINCRBY', req, 'claims_lost', 1)
end
local done = redis.call('HGET', req, 'completion_tokens') or '0'
if redis.call('HEXISTS', req, 'cancel_requested_ms') == 1 then
  close(running, req, out, metrics, id, 'cancelled', now, tonumber(ttl), done, 'cancelled', cancelled_event())
  return ENDED
end
local most = tonumber(most_lost)
if most > 0 and times_lost >= most then
  close(running, req, out, metrics, id, 'failed', now, tonumber(ttl), done, 'worker_lost',
    {'type', 'error', 'code', 'worker_lost',
     'message', 'the request was lost by ' .. times_lost .. ' workers in a row (they died or froze while running it)'})
  return ENDED
end
redis.call('ZREM', running, id)
redis.call('HSET', req, 'status', 'waiting', 'worker', '', 'slot', '', 'requeued_ms', now)
redis.call('HINCRBY', req, 'requeues', 1)
local place = redis.call('HMGET', req, 'score', 'priority', 'member')
redis.call('ZADD', waiting, place[1] or -tonumber(place[2]), place[3])
return REQUEUED
