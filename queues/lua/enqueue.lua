--[[ enqueue: a new request joins the waiting queue.
Moves: new -> waiting
KEYS: seq counter, waiting zset, request hash, wake list, deadlines zset,
  policy hash (aging_s, aging_epoch_ms: see queues/keys.py)
ARGV: request id, priority, prompt (JSON ids), prompt length, params (JSON), now (ms),
  max waiting ahead (0 = unbounded), hard limit on the whole queue (0 = unbounded),
  queue deadline (ms): not claimed by then, it expires (expire.lua); '' = none;
  then optional extra fields of the request hash as field, value pairs (e.g. key_name)
Returns {member, number waiting ahead of it}.
Errors (QueueError): QUEUE_FULL (shed: as many requests of this priority or higher already
wait, or the queue is at its hard limit), DUPLICATE (the id exists).
Lower priorities are shed first: a request is refused when max-ahead requests that would be
served before it already wait, so a full queue of priority 0 still accepts a priority 9.
Score: -priority; with aging (the policy hash has aging_s) (now - epoch)/1000/aging_s - priority,
which orders the queue at every instant as priority + waited/aging_s would, so nothing is ever
rescored. It is stored on the hash (score) so that a requeue puts the request back in its place. ]]
local seq_counter, waiting, req, wake, deadlines, policy = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, priority, prompt, prompt_tokens, params, now, max_ahead, hard_limit, queue_deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local EXTRA = 10  -- ARGV from here on: the extra field, value pairs

local score = -tonumber(priority)
local aging = redis.call('HMGET', policy, 'aging_s', 'aging_epoch_ms')
if aging[1] and aging[2] then
  score = (tonumber(now) - tonumber(aging[2])) / 1000 / tonumber(aging[1]) - tonumber(priority)
end
score = string.format('%.17g', score)
if redis.call('EXISTS', req) == 1 then
  return redis.error_reply('DUPLICATE')
end
local ahead = redis.call('ZCOUNT', waiting, '-inf', score)
local most_ahead, hard = tonumber(max_ahead), tonumber(hard_limit)
if (most_ahead > 0 and ahead >= most_ahead) or (hard > 0 and redis.call('ZCARD', waiting) >= hard) then
  return redis.error_reply('QUEUE_FULL')
end
local seq = redis.call('INCR', seq_counter)
local member = string.format('%012d:%s', seq, id)
redis.call('HSET', req,
  'id', id, 'priority', priority, 'status', 'waiting', 'member', member,
  'prompt_tokens', prompt_tokens, 'prompt', prompt, 'params', params,
  'enqueued_ms', now, 'attempts', 0, 'score', score)
if queue_deadline ~= '' then
  redis.call('HSET', req, 'queue_deadline_ms', queue_deadline)
  redis.call('ZADD', deadlines, queue_deadline, id)
end
if #ARGV > EXTRA then
  redis.call('HSET', req, unpack(ARGV, EXTRA))
end
redis.call('ZADD', waiting, score, member)
redis.call('LPUSH', wake, member)
redis.call('LTRIM', wake, 0, 63)
return {member, ahead}
