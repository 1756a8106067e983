--[[ head: the first `count` members of the waiting set in service order, each with the priority,
n and affinity key (queues/affinity.py) of its request hash, in one round trip (a ZRANGE and then
an HMGET per member took two). It only reads. The request hashes are named from `req_prefix`
(Keys.req of an empty id): they carry the waiting set's hash tag, so on Redis Cluster they live
in the same slot.
KEYS: waiting zset
ARGV: count, request hash prefix
Returns a flat list: member, priority, n, affinity, for each member (a field the hash lacks: nil). ]]
local waiting = KEYS[1]
local count, req_prefix = ARGV[1], ARGV[2]

local head = {}
for _, member in ipairs(redis.call('ZRANGE', waiting, 0, tonumber(count) - 1)) do
  local id = string.sub(member, string.find(member, ':', 1, true) + 1)
  local h = redis.call('HMGET', req_prefix .. id, 'priority', 'n', 'affinity')
  head[#head + 1] = member
  head[#head + 1] = h[1]
  head[#head + 1] = h[2]
  head[#head + 1] = h[3]
end
return head
