--[[ enqueue: a new request joins the waiting queue.
Moves: new -> waiting
KEYS[1] seq counter      KEYS[2] waiting zset   KEYS[3] request hash   KEYS[4] wake list
KEYS[5] deadlines zset   KEYS[6] policy hash (aging_s, aging_epoch_ms: see queues/keys.py)
ARGV[1] id   ARGV[2] priority   ARGV[3] prompt (JSON ids)   ARGV[4] prompt length
ARGV[5] params (JSON)   ARGV[6] now (ms)   ARGV[7] max waiting ahead (0 = unbounded)
ARGV[8] hard limit on the whole queue (0 = unbounded)
ARGV[9] queue deadline (ms): not claimed by then, it expires (expire.lua); '' = none
ARGV[10..] optional extra fields of the request hash as field, value pairs (e.g. key_name)
Returns {member, number waiting ahead of it}.
Errors: QUEUE_FULL (shed: as many requests of this priority or higher already wait, or the
queue is at its hard limit), DUPLICATE (the id exists).
Lower priorities are shed first: a request is refused when max-ahead requests that would be
served before it already wait, so a full queue of priority 0 still accepts a priority 9.
Score: -priority; with aging (the policy hash has aging_s) (now - epoch)/1000/aging_s - priority,
which orders the queue at every instant as priority + waited/aging_s would, so nothing is ever
rescored. It is stored on the hash (score) so that a requeue puts the request back in its place. ]]
local priority = tonumber(ARGV[2])
local score = -priority
local aging = redis.call('HMGET', KEYS[6], 'aging_s', 'aging_epoch_ms')
if aging[1] and aging[2] then
  score = (tonumber(ARGV[6]) - tonumber(aging[2])) / 1000 / tonumber(aging[1]) - priority
end
score = string.format('%.17g', score)
if redis.call('EXISTS', KEYS[3]) == 1 then
  return redis.error_reply('DUPLICATE')
end
local ahead = redis.call('ZCOUNT', KEYS[2], '-inf', score)
local max_ahead = tonumber(ARGV[7])
local hard = tonumber(ARGV[8])
if (max_ahead > 0 and ahead >= max_ahead) or (hard > 0 and redis.call('ZCARD', KEYS[2]) >= hard) then
  return redis.error_reply('QUEUE_FULL')
end
local seq = redis.call('INCR', KEYS[1])
local member = string.format('%012d:%s', seq, ARGV[1])
redis.call('HSET', KEYS[3],
  'id', ARGV[1], 'priority', ARGV[2], 'status', 'waiting', 'member', member,
  'prompt_tokens', ARGV[4], 'prompt', ARGV[3], 'params', ARGV[5],
  'enqueued_ms', ARGV[6], 'attempts', 0, 'score', score)
if ARGV[9] ~= '' then
  redis.call('HSET', KEYS[3], 'queue_deadline_ms', ARGV[9])
  redis.call('ZADD', KEYS[5], ARGV[9], ARGV[1])
end
if #ARGV >= 11 then
  redis.call('HSET', KEYS[3], unpack(ARGV, 10))
end
redis.call('ZADD', KEYS[2], score, member)
redis.call('LPUSH', KEYS[4], member)
redis.call('LTRIM', KEYS[4], 0, 63)
return {member, ahead}
